"""The demo: a small MoE model that ships with moescope, and the story `moescope demo` tells with it.

- `story`: the scripted run (healthy traffic, a traffic shift, a corrupted expert) and its figures.
- `model/`: the committed checkpoint (a 2.8M-parameter Mixtral), `data`: its corpus and loader.
- `train`: the seeded recipe that trained it (`moescope train-demo`), `model_card`: the card it
  writes beside the checkpoint, `specialisation`: how much its experts specialise by domain.
- `capacity`: the GShard / Switch / Megatron expert capacity the demo model runs with.
- `receiver`: a webhook receiver that checks signatures, for the demo and for your own tests.
"""
