"""The jitter check's padded batches get the position ids transformers' own `generate` feeds.

The expected ids are read from a real `model.generate` call: a hook of the test's own keeps the
`position_ids` of generate's first forward (the prompt's prefill) over the same padded batch.
Pad slots are routed too, so a pad's position changes how a batch's tokens group per expert."""

from __future__ import annotations

import torch

from moescope.analyses.jitter import generate_position_ids, jitter
from tests.support.jitter import near_tied_mixtral, token_lists


def _fed(model, call) -> list[dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "position_ids") if kwargs.get(k) is not None}),
        with_kwargs=True)
    try:
        with torch.no_grad():
            call()
    finally:
        handle.remove()
    return seen


def test_padded_batches_get_generates_position_ids_pads_included():
    model = near_tied_mixtral()
    inputs = token_lists()
    forwards = _fed(model, lambda: jitter(model, inputs, conditions=("left_padding",), batch_size=4))
    batched = forwards[len(inputs):]  # after the baseline's forwards, one input each
    assert len(batched) == 4  # right-padded, then left-padded, two batches of four each
    for forward in batched:
        prefill = _fed(model, lambda: model.generate(input_ids=forward["input_ids"],
                                                     attention_mask=forward["attention_mask"], max_new_tokens=1,
                                                     do_sample=False, pad_token_id=0))[0]
        assert torch.equal(prefill["position_ids"], forward["position_ids"])
        pads = forward["attention_mask"] == 0
        assert pads.any() and (forward["position_ids"][pads] == 0).all()


def test_the_rule_on_a_right_padded_mask():
    """Written out by hand for one mask: pad slots at 0, not the last real position repeated."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert generate_position_ids(mask).tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
