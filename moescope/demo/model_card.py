"""The demo model's card (its README): what the model is, its data, how it was trained, how much its
experts specialise, and the share of its parameters a token uses, all from the training summary
that `moescope.demo.train` writes beside the checkpoint. `tests/unit/demo/test_demo_model.py` checks
that the committed card is exactly what `model_card` makes of the committed summary.
"""

from __future__ import annotations

from moescope.demo.data import DOMAINS


def model_card(summary: dict) -> str:
    """The demo model's README: data, size, seed, command, time, losses and specialisation."""
    return (_card_model_section(summary) + _card_data_section(summary) + _card_training_section(summary)
            + _card_specialisation_section(summary) + active_fraction_section(summary))


def _card_model_section(summary: dict) -> str:
    """The card's title, what the model is for, and its "Model" section: size, capacity, tokenizer."""
    recipe = summary["recipe"]
    return f"""# moescope demo model

A small `MixtralForCausalLM` trained from scratch so the moescope demo can show real, specialised
routing without downloading anything. It is not a useful language model; it is a model whose
routers have learnt something worth watching, and whose experts have a capacity, so the share of
its parameters a token uses varies with the token.

## Model

- {recipe['num_hidden_layers']} decoder layers, hidden size {recipe['hidden_size']}, \
{recipe['num_local_experts']} experts per layer (intermediate size {recipe['intermediate_size']}), \
top-{recipe['num_experts_per_tok']} routing, {recipe['num_attention_heads']} attention heads \
({recipe['num_key_value_heads']} key/value heads), tied input/output embeddings.
- Expert capacity with token dropping, as GShard, Switch Transformer and Megatron-Core
  (`moe_expert_capacity_factor`, `moe_token_drop_policy="position"`) run it
  (`moescope/demo/capacity.py`): per sequence, each expert takes at most
  `ceil({recipe['capacity_factor']} × sequence length × {recipe['num_experts_per_tok']} / \
{recipe['num_local_experts']})` (token, slot) assignments; every token's first choice is placed before
  any second choice, and within a choice earlier positions win. A dropped slot's weight is zero
  (the other is not renormalised): the token does not use that expert's parameters and still
  passes through the residual. Decoding one token at a time never drops (a one-token sequence
  has capacity ≥ 1 and its experts are distinct). Padded positions (a 2-D `attention_mask`) are
  never dispatched.
- The config records `capacity_factor: {recipe['capacity_factor']}`; `moescope.demo.data.load_demo_model`
  installs the capacity from it. Plain `MixtralForCausalLM.from_pretrained` ignores that field and
  gives the dropless model (every token uses exactly its top-{recipe['num_experts_per_tok']}).
- {summary['parameters']:,} parameters, float32 safetensors.
- Tokenizer: byte-level BPE, {recipe['vocab_size']} tokens, trained with `tokenizers` on the first
  {recipe['tokenizer_chars_per_domain']:,} characters of each domain's training split{_digits_note(recipe)};
  `<|endoftext|>` is bos, eos and pad. Saved as a `PreTrainedTokenizerFast`.

"""


def _card_data_section(summary: dict) -> str:
    """The card's "Data" section: the three domains, their held-out split and the batch mix."""
    recipe = summary["recipe"]
    return f"""## Data

Three domains, all from Python {summary['python']} itself (see `moescope/demo/data.py`); every
fifth file, topic or operand pair is held out and never trained on:

- **code**: the standard library's top-level `*.py` modules, sorted by name;
- **prose**: the reference-manual topics in `pydoc_data.topics.topics`;
- **math**: generated lines like `37 + 58 = 95` (`+`, `-`, `*` on 0–99), seeded.

Each training row is {recipe['sequence_length']} tokens of one domain; {_batch_mix(recipe)}

"""


def _card_training_section(summary: dict) -> str:
    """The card's "Training" section: the command, seed, schedule, time and the losses per domain."""
    recipe = summary["recipe"]
    router_scale = recipe["router_lr_scale"]
    spec = summary["specialisation"]
    loss_rows = "\n".join(f"| {d} | {summary['train_loss_ema'][d]:.3f} | {summary['held_out_loss'][d]:.3f} |"
                          for d in summary["held_out_loss"])
    return f"""## Training

```
{summary['command']}
```

Seed {summary['seed']}: `torch.manual_seed` for the weights, a seeded `torch.Generator` for the batch
order. {recipe['steps']} AdamW steps, peak learning rate {recipe['learning_rate']} ({router_scale}× that for the
router weights), warm-up
{recipe['warmup_steps']} steps then cosine decay, gradient clipping 1.0, the model's own load-balancing
loss with `router_aux_loss_coef={recipe['router_aux_loss_coef']}`, the expert capacity on (as Switch
and GShard train). Took **{summary['train_seconds']:.0f} s**
of wall time and {summary['train_cpu_seconds']:.0f} s of CPU time with {summary['threads']} torch thread(s) on a
shared 2-core machine (torch {summary['torch']}, transformers {summary['transformers']}), tokenizer training
included. Final load-balancing loss (moving average): {summary['router_aux_loss_ema']:.3f}
({recipe['num_experts_per_tok']}.0 is perfectly balanced for this loss).

| domain | training loss (moving average) | held-out loss |
|---|---|---|
{loss_rows}

Losses are next-token cross-entropy in nats; held-out figures are on {spec['texts_per_domain']} held-out
texts per domain (`domain_texts(domain, {spec['texts_per_domain']}, seed=0)`).

"""


def _card_specialisation_section(summary: dict) -> str:
    """The card's "Top-1 specialisation" section: NMI per layer, trained and random, and each domain's
    favourite expert; and how it differs from the demo's kept-slot figure."""
    spec = summary["specialisation"]
    held_out_tokens = ", ".join(f"{n:,} {d}" for d, n in spec["tokens_per_domain"].items())
    layer_rows = "\n".join(
        f"| {layer} | {trained:.3f} | {random:.3f} | "
        + ", ".join(f"{d} → {e} ({share:.0%})" for d, (e, share) in spec["favourite_experts"][layer].items()) + " |"
        for layer, (trained, random) in enumerate(zip(spec["trained_nmi"], spec["random_nmi"])))
    return f"""## Top-1 specialisation

Normalised mutual information between a token's domain and the expert its router ranks first
(before the capacity drops anything), per layer, on the same held-out texts ({held_out_tokens}
tokens), against the same config with random weights. Measured by
`moescope.demo.specialisation.measure_specialisation`; the last column gives each domain's most
chosen top-1 expert and the share of that domain's tokens it takes.

| layer | NMI trained | NMI random weights | favourite expert per domain |
|---|---|---|---|
{layer_rows}

A layer whose NMI stays near the random figure routes by something other than the domain (token
identity, position); a layer whose favourite expert is the same for every domain has a hot expert
that the load-balancing loss, which balances top-2 choices rather than top-1, tolerates. Both are
worth seeing in the dashboard.

This is not the figure `moescope demo` prints and the dashboard's Semantic clusters page draws.
That one, *kept-slot specialisation*, is NMI(expert; domain) over every top-k slot an expert kept
(second choices in, slots dropped at capacity out), on the demo's traffic, and it comes out lower
than the top-1 figures above: second choices are less tied to a domain than first ones, and the
capacity caps the slots an expert keeps per sequence (see Model), so a domain's favourite expert
keeps only part of its first choices. Both use `moescope.metrics.signals.normalized_mutual_information`;
they count different things.
"""


def _batch_mix(recipe: dict) -> str:
    rows = recipe.get("rows_per_domain")
    if rows is None:
        return f"every batch of {recipe['batch_size']} rows takes the domains in turn."
    mix = ", ".join(f"{n} {d}" for d, n in zip(DOMAINS, rows))
    return f"every batch of {recipe['batch_size']} rows holds {mix} rows."


def active_fraction_section(summary: dict) -> str:
    """The model card's "Active parameters per token" section (empty for a summary without it)."""
    active = summary.get("active_fraction")
    if not active:
        return ""
    buckets = active["position_buckets"]
    head = " | ".join(f"positions {a}–{b - 1}" for a, b in buckets)
    rows = "\n".join(f"| {d} | {100 * active['by_domain'][d]:.2f}% | "
                     + " | ".join(f"{100 * v:.2f}%" for v in active["by_domain_position"][d])
                     + f" | {100 * active['dropped_slot_share'][d]:.1f}% |" for d in active["by_domain"])
    every = " | ".join(f"{100 * v:.2f}%" for v in active["by_position"])
    ranked = sorted(active["by_domain"].items(), key=lambda item: -item[1])
    gap = 100 * (ranked[0][1] - ranked[-1][1])
    drift = 100 * (active["by_position"][0] - active["by_position"][-1])
    return f"""
## Active parameters per token

The share of all {summary['parameters']:,} parameters a token used: every parameter outside the
experts counts for every token, and an expert's parameters count when the token kept a slot
there (the probe's convention). Without the capacity every token would use
{100 * active['dropless_fraction']:.2f}% (its top-{summary['recipe']['num_experts_per_tok']} in every
layer); a token whose every slot was dropped in every layer would use {100 * active['shared_fraction']:.2f}%.
Measured by `moescope.demo.train.active_fraction_profile` on {active['windows_per_domain']} held-out
inputs of exactly {active['length']} tokens per domain
(`domain_windows(tokenizer, domain, {active['windows_per_domain']}, {active['length']}, seed=0)`, no padding),
one input per sequence.

| domain | mean | {head} | slots dropped |
|---|---|{"---|" * len(buckets)}---|
{rows}
| all | | {every} | |

{ranked[0][0].capitalize()} used the most, {ranked[-1][0]} the least: {gap:.2f} percentage points apart. The share
falls with position, by {drift:.2f} points from the first quarter of the input to the last. Both
are the known behaviour of capacity-based token dropping: a sequence whose tokens crowd onto a
few experts overflows them, and under the position policy later tokens lose their slots first:
the further into a long input a token sits, the fewer parameters it uses.{_mix_note(summary, ranked[-1][0])}
Tokens decoded one at a time never lose a slot, and a dropless run of the same weights (plain
`from_pretrained`) uses {100 * active['dropless_fraction']:.2f}% for every token.
"""


def _digits_note(recipe: dict) -> str:
    return ", numbers split into single digits (as Llama's and Mistral's tokenizers do)" if recipe.get(
        "split_digits") else ""


def _mix_note(summary: dict, least: str) -> str:
    """Why one domain loses more slots, where the recipe's training mix is what makes it so."""
    recipe = summary["recipe"]
    rows = recipe.get("rows_per_domain")
    if rows is None or least not in DOMAINS:
        return ""
    share = rows[DOMAINS.index(least)]
    digits = (" is written with about sixteen symbols (single digits, operators, spaces, newlines) and"
              if least == "math" and recipe.get("split_digits") else "")
    return f"""
Which domain crowds its experts comes from its text and the training mix: {least}{digits} is
{share} row in {recipe['batch_size']} of every batch, and the load-balancing loss balances whole batches, so it
leaves {least} few experts of its own; its sequences crowd onto them and overflow more often
({100 * summary['active_fraction']['dropped_slot_share'][least]:.1f}% of its chosen slots dropped)."""
