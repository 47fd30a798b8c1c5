"""Train the demo model: a small LongCat-Flash whose experts specialise and whose compute per token
varies, from text that ships with Python.

The newcomer's demo has to show real routing offline, so the repository carries a checkpoint
trained by this script on the three domains of :mod:`moescope.demo_data` (stdlib source code,
pydoc prose, generated arithmetic). Everything is decided by the seed: the tokenizer is trained
on a fixed slice of the corpus, the weights start from ``torch.manual_seed(seed)``, and the batch
order comes from a ``torch.Generator`` seeded the same way. The full run is sized to take under
ten CPU-minutes on one thread.

Why LongCat-Flash: its router chooses k slots among the routed experts *and* a few zero-
computation (identity) experts, so a token that takes a zero expert runs fewer expert parameters:
the fraction of parameters a token uses varies with the token, as in the field's "uses N% of its
parameters" claims. Training follows LongCat-Flash's recipe at toy scale: an expert bias,
updated after every step outside the gradient, steers the average number of routed experts per
token to a budget (`compute_target`) while leaving each token free to use more or fewer; a
load-balancing loss in the style of MoE++ (zero experts weighted by `zero_expert_balance`)
keeps the routed experts in use.

Run it as ``python -m moescope.train_demo`` (or ``moescope train-demo`` once the CLI wires
:func:`add_arguments` and :func:`run`). ``--quick`` trains a tiny model for a few steps, for tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time
from dataclasses import asdict, dataclass

import torch

from moescope.demo_data import DOMAINS, demo_model_path, domain_documents, domain_texts

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything besides the seed that decides the trained model."""

    vocab_size: int
    hidden_size: int
    # LongCat-Flash layers: two attention sublayers, two dense MLPs and one MoE each.
    num_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_intermediate_size: int
    expert_intermediate_size: int
    num_routed_experts: int
    zero_experts: int
    top_k: int
    max_position_embeddings: int
    # Weight of the load-balancing loss (Switch uses 0.01).
    balance_loss_coef: float
    # A zero expert's weight in that loss (MoE++'s tau): below 1, a token may take zero experts
    # more freely than it may crowd one routed expert.
    zero_expert_balance: float
    # Routed experts per token (of top_k) the expert-bias controller steers the average to.
    compute_target: float
    # Step of the expert-bias controller (LongCat-Flash's mu), per optimiser step.
    bias_update_rate: float
    steps: int
    batch_size: int
    sequence_length: int
    learning_rate: float
    # Routers learn slowly: only the relative weight of the chosen experts carries gradient back
    # to them. A higher rate for router weights lets domains find their experts within a short run.
    router_lr_scale: float
    warmup_steps: int
    # Characters per domain the tokenizer learns from, so stdlib code (ten times the prose)
    # does not claim most of the vocabulary.
    tokenizer_chars_per_domain: int
    # Cap on the code and prose corpora (files and topics, in order); size of the math corpus.
    max_documents: int | None
    math_documents: int
    # Held-out texts per domain for the final loss and the specialisation figures.
    eval_texts_per_domain: int


FULL_RECIPE = DemoRecipe(
    vocab_size=2048, hidden_size=128, num_layers=4, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, dense_intermediate_size=64,
    expert_intermediate_size=192, num_routed_experts=8, zero_experts=4, top_k=2, max_position_embeddings=512,
    balance_loss_coef=0.02, zero_expert_balance=0.25, compute_target=1.0, bias_update_rate=1e-3, steps=1000,
    batch_size=16, sequence_length=128, learning_rate=2e-3, router_lr_scale=5.0, warmup_steps=60,
    tokenizer_chars_per_domain=400_000, max_documents=None, math_documents=2000, eval_texts_per_domain=60,
)

QUICK_RECIPE = DemoRecipe(
    vocab_size=384, hidden_size=32, num_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, dense_intermediate_size=16, expert_intermediate_size=48,
    num_routed_experts=8, zero_experts=4, top_k=2, max_position_embeddings=256, balance_loss_coef=0.02,
    zero_expert_balance=0.25, compute_target=1.0, bias_update_rate=1e-3, steps=4, batch_size=6, sequence_length=32,
    learning_rate=2e-3, router_lr_scale=5.0, warmup_steps=1, tokenizer_chars_per_domain=20_000, max_documents=3,
    math_documents=20, eval_texts_per_domain=4,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train-demo`` options to `parser`."""
    parser.add_argument("--out", type=pathlib.Path, default=demo_model_path(),
                        help="folder to write the checkpoint, tokenizer and model card to "
                             "(default: the package's moescope/demo_model)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights, data order and math corpus")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimiser steps (default {FULL_RECIPE.steps}, or {QUICK_RECIPE.steps} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model on a tiny corpus for a few steps: checks the pipeline, not a demo model")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: on a shared 2-core machine two threads "
                             "spend most of their time waiting for each other, measured ~3x slower)")


def run(args: argparse.Namespace) -> int:
    """Train and save the demo model as `args` says; returns the process exit status (0)."""
    recipe = QUICK_RECIPE if args.quick else FULL_RECIPE
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {args.steps}")
        recipe = DemoRecipe(**{**asdict(recipe), "steps": args.steps})
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    train_demo_model(pathlib.Path(args.out), recipe, seed=args.seed, threads=args.threads,
                     command=_command_line(args))
    return 0


def _command_line(args: argparse.Namespace) -> str:
    parts = ["python -m moescope.train_demo", f"--seed {args.seed}", f"--threads {args.threads}"]
    if args.steps is not None:
        parts.append(f"--steps {args.steps}")
    if args.quick:
        parts.append("--quick")
    return " ".join(parts)


def training_documents(recipe: DemoRecipe, seed: int) -> dict[str, list[str]]:
    """The training split of every domain, capped as `recipe` says."""
    documents = {domain: domain_documents(domain, "train", seed=seed, math_documents=recipe.math_documents)
                 for domain in DOMAINS}
    if recipe.max_documents is not None:
        for domain in ("code", "prose"):
            documents[domain] = documents[domain][:recipe.max_documents]
    return documents


def _leading_chars(documents: list[str], budget: int) -> list[str]:
    """The first `budget` characters of the documents, in order."""
    kept, used = [], 0
    for document in documents:
        if used >= budget:
            break
        kept.append(document[:budget - used])
        used += len(kept[-1])
    return kept


def train_tokenizer(documents: dict[str, list[str]], vocab_size: int, chars_per_domain: int):
    """A byte-level BPE tokenizer learnt from the first `chars_per_domain` characters of each domain.

    Byte-level means every string round-trips exactly, whatever characters it holds. Returns a
    ``transformers.PreTrainedTokenizerFast`` whose bos, eos and pad token is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [text for domain in DOMAINS for text in _leading_chars(documents[domain], chars_per_domain)]
    tokenizer.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT, clean_up_tokenization_spaces=False)


def token_streams(tokenizer, documents: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Each domain's documents tokenised and joined into one stream, an end-of-text token after each."""
    eos = tokenizer.eos_token_id
    streams = {}
    for domain in DOMAINS:
        ids: list[int] = []
        for encoding in tokenizer.backend_tokenizer.encode_batch(documents[domain], add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eos)
        streams[domain] = torch.tensor(ids, dtype=torch.long)
    return streams


def _check_streams(streams: dict[str, torch.Tensor], sequence_length: int) -> None:
    for domain, stream in streams.items():
        if stream.numel() <= sequence_length:
            raise ValueError(f"the {domain} corpus has only {stream.numel()} tokens, fewer than one sequence "
                             f"of {sequence_length}; use a longer corpus or a shorter sequence")


def sample_batch(streams: dict[str, torch.Tensor], step: int, batch_size: int, sequence_length: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch: token windows and the index of each row's domain.

    Rows take the domains in turn, so every batch holds the domains in (nearly) equal shares and
    the load-balancing loss cannot be met by giving each batch to one domain's experts. Each row
    is one domain only: the routing a row shows is that domain's routing.
    """
    rows, domain_of_row = [], []
    for row in range(batch_size):
        domain_index = (step * batch_size + row) % len(DOMAINS)
        stream = streams[DOMAINS[domain_index]]
        start = int(torch.randint(0, stream.numel() - sequence_length, (1,), generator=generator))
        rows.append(stream[start:start + sequence_length])
        domain_of_row.append(domain_index)
    return torch.stack(rows), torch.tensor(domain_of_row)


def token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of every position but the last, shape ``[batch, seq - 1]``."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1), reduction="none",
    ).view(input_ids.shape[0], -1)


def learning_rate_at(step: int, recipe: DemoRecipe) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_model(recipe: DemoRecipe, tokenizer, seed: int):
    """A freshly initialised ``LongcatFlashForCausalLM`` of the recipe's shape, seeded with `seed`."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    config = LongcatFlashConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_attention_heads,
        q_lora_rank=recipe.q_lora_rank, kv_lora_rank=recipe.kv_lora_rank, qk_nope_head_dim=recipe.qk_nope_head_dim,
        qk_rope_head_dim=recipe.qk_rope_head_dim, head_dim=recipe.qk_rope_head_dim, v_head_dim=recipe.v_head_dim,
        ffn_hidden_size=recipe.dense_intermediate_size, expert_ffn_hidden_size=recipe.expert_intermediate_size,
        n_routed_experts=recipe.num_routed_experts, zero_expert_num=recipe.zero_experts, moe_topk=recipe.top_k,
        # LongCat-Flash scales by 6 over 768 slots; over a dozen the softmax weights are already O(1).
        routed_scaling_factor=1.0, max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LongcatFlashForCausalLM(config)


class RouterTap:
    """Forward hooks that keep each MoE router's latest (logits, chosen slots), in layer order."""

    def __init__(self, model):
        from moescope.specialisation import router_modules

        self.routers = router_modules(model)
        self.outputs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.routers)
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def _hook(self, index: int):
        def keep(module, inputs, output) -> None:
            self.outputs[index] = (output[0], output[2])  # (router_logits, topk_indices)
        return keep

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def balance_loss(router_logits: torch.Tensor, chosen: torch.Tensor, num_routed: int,
                 zero_expert_weight: float) -> torch.Tensor:
    """Switch-style load-balancing loss over every slot, zero experts weighted by
    `zero_expert_weight` (MoE++'s heterogeneous balance): slots x sum(weight * share * mean prob).

    1.0 when routing is uniform and every weight is 1."""
    slots = router_logits.shape[-1]
    share = torch.nn.functional.one_hot(chosen, slots).sum(dim=1).float().mean(dim=0) / chosen.shape[-1]
    weight = torch.ones(slots, device=router_logits.device)
    weight[num_routed:] = zero_expert_weight
    return slots * (weight * share * router_logits.float().softmax(dim=-1).mean(dim=0)).sum()


@torch.no_grad()
def steer_expert_bias(router, chosen: torch.Tensor, num_routed: int, compute_target: float, rate: float) -> None:
    """LongCat-Flash's compute-budget control: move each routed expert's selection bias by `rate`
    towards its share of a budget of `compute_target` routed experts per token (the update's sign,
    as DeepSeek-V3's bias balancing); zero experts keep bias 0. Changes only which slots top-k
    picks, not the gate weights."""
    slots = router.e_score_correction_bias.numel()
    share = torch.bincount(chosen.reshape(-1), minlength=slots).float() / chosen.numel()
    target = compute_target / chosen.shape[-1] / num_routed
    router.e_score_correction_bias[:num_routed] += rate * torch.sign(target - share[:num_routed])


def expert_parameters(model) -> tuple[int, int, int]:
    """(all parameters, parameters per routed expert, routed-expert parameters of every layer with
    the zero experts' unused rows of the fused weights), by the probe's convention."""
    from moescope.specialisation import router_modules

    total = sum(p.numel() for p in model.parameters())
    routed = per_expert = 0
    for router in router_modules(model):
        experts = router_parent(model, router).experts
        routed += sum(p.numel() for p in experts.parameters())
        per_expert = 3 * experts.hidden_size * experts.intermediate_size  # gate, up and down rows of one expert
    return total, per_expert, routed


def router_parent(model, router):
    """The MoE block that holds `router` (its ``experts`` sit beside it)."""
    return next(module for module in model.modules() if getattr(module, "router", None) is router)


@torch.no_grad()
def compute_figures(model, tokenizer, texts_per_domain: int, positions: tuple[int, ...] = (0, 8, 32, 64, 96)) -> dict:
    """How much of the model each domain's tokens use, on held-out texts (``domain_texts(d, n, seed=0)``).

    Per domain: routed experts per token per layer, and the active-parameter fraction (the
    probe's convention: every parameter outside the routed experts, plus the routed experts a
    token used, over all parameters), token-weighted overall and by position bucket (positions
    ``positions[i] <= p < positions[i + 1]``, the last open).
    """
    model.eval()
    tap = RouterTap(model)
    total, per_expert, routed = expert_parameters(model)
    shared = total - routed
    routed_experts = int(model.config.num_local_experts)
    edges = list(positions) + [10**9]
    out: dict = {"total_params": total, "params_per_expert": per_expert, "shared_params": shared,
                 "positions": list(positions), "domains": {}}
    try:
        for domain in DOMAINS:
            used_per_layer, active, position = [], [], []
            for text in domain_texts(domain, texts_per_domain, seed=0):
                ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
                if ids.shape[1] == 0:
                    continue
                model(input_ids=ids)
                used = torch.stack([(chosen < routed_experts).sum(dim=-1) for _, chosen in tap.outputs])  # (L, T)
                used_per_layer.append(used.float())
                active.append((shared + per_expert * used.sum(dim=0).double()) / total)
                position.append(torch.arange(ids.shape[1]))
            used, frac, pos = torch.cat(used_per_layer, 1), torch.cat(active), torch.cat(position)
            out["domains"][domain] = {
                "tokens": int(frac.numel()),
                "routed_experts_per_layer": [round(float(v), 4) for v in used.mean(dim=1)],
                "active_fraction": round(float(frac.mean()), 6),
                "active_fraction_by_position": [
                    round(float(frac[(pos >= lo) & (pos < hi)].mean()), 6) if ((pos >= lo) & (pos < hi)).any()
                    else None for lo, hi in zip(edges[:-1], edges[1:])],
            }
    finally:
        tap.close()
    return out


@torch.no_grad()
def held_out_losses(model, tokenizer, texts_per_domain: int, seed: int) -> dict[str, float]:
    """Mean next-token loss per domain on held-out texts (:func:`moescope.demo_data.domain_texts`)."""
    model.eval()
    losses = {}
    for domain in DOMAINS:
        total, count = 0.0, 0
        for text in domain_texts(domain, texts_per_domain, seed=seed):
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            if ids.shape[1] < 2:
                continue
            per_token = token_losses(model(input_ids=ids).logits, ids)
            total += float(per_token.sum())
            count += per_token.numel()
        losses[domain] = total / max(count, 1)
    return losses


def evaluate_demo_model(model, tokenizer, texts_per_domain: int, random_seed: int = 0) -> dict:
    """Held-out loss per domain, the compute figures and the specialisation figures, as the training
    summary stores them.

    All use ``domain_texts(domain, texts_per_domain, seed=0)``; the random-weight baseline is
    seeded with `random_seed`. Returns ``{"held_out_loss": ..., "compute": ..., "specialisation": ...}``.
    """
    from moescope.specialisation import measure_specialisation

    model.eval()
    held_out = held_out_losses(model, tokenizer, texts_per_domain, seed=0)
    texts = {domain: domain_texts(domain, texts_per_domain, seed=0) for domain in DOMAINS}
    report = measure_specialisation(model, tokenizer, texts, random_seed=random_seed)
    return {
        "held_out_loss": {d: round(v, 4) for d, v in held_out.items()},
        "compute": compute_figures(model, tokenizer, texts_per_domain),
        "specialisation": {
            "texts_per_domain": texts_per_domain,
            "tokens_per_domain": report.tokens_per_domain,
            "trained_nmi": [round(v, 4) for v in report.trained_nmi],
            "random_nmi": [round(v, 4) for v in report.random_nmi],
            "favourite_experts": [{d: [e, round(share, 3)] for d, (e, share) in layer.items()}
                                  for layer in report.favourite_experts()],
            "top1_share_per_expert": [[round(float(c), 3) for c in layer.sum(axis=0) / layer.sum()]
                                      for layer in report.trained_counts],
        },
    }


def train_demo_model(out: pathlib.Path, recipe: DemoRecipe = FULL_RECIPE, seed: int = 0, threads: int = 1,
                     command: str = "python -m moescope.train_demo") -> dict:
    """Train the demo model and write it, its tokenizer and a model card to `out`.

    Returns the training summary that is also written to ``out/training_summary.json``: the
    recipe, seed, wall time, final training and held-out losses per domain, and the
    specialisation figures (NMI per layer, trained and random weights).
    """
    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    # The tokenizers library has its own thread pool; keep it within the same share of the CPU.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    started = time.perf_counter()
    # CPU time as well as wall time: on a shared machine the wall clock mostly measures the neighbours.
    cpu_started = time.process_time()

    documents = training_documents(recipe, seed)
    tokenizer = train_tokenizer(documents, recipe.vocab_size, recipe.tokenizer_chars_per_domain)
    tokenizer.model_max_length = recipe.max_position_embeddings
    streams = token_streams(tokenizer, documents)
    _check_streams(streams, recipe.sequence_length)
    model = build_model(recipe, tokenizer, seed)
    model.train()
    tap = RouterTap(model)

    router_weights = [router.classifier.weight for router in tap.routers]
    router_ids = {id(weight) for weight in router_weights}
    other_weights = [p for p in model.parameters() if id(p) not in router_ids]
    optimizer = torch.optim.AdamW([{"params": other_weights, "lr_scale": 1.0},
                                   {"params": router_weights, "lr_scale": recipe.router_lr_scale}],
                                  lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    # Exponential moving averages of the training loss per domain, the balance loss and the
    # routed experts per token, for the progress bar and the card.
    domain_loss_ema: dict[str, float | None] = {domain: None for domain in DOMAINS}
    aux_loss_ema: float | None = None
    routed_ema: float | None = None
    progress = tqdm(range(recipe.steps), desc="train-demo", unit="step")
    for step in progress:
        input_ids, domain_of_row = sample_batch(streams, step, recipe.batch_size, recipe.sequence_length, generator)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, recipe) * group["lr_scale"]
        logits = model(input_ids=input_ids).logits
        per_row = token_losses(logits, input_ids).mean(dim=1)
        aux = sum(balance_loss(router_logits, chosen, recipe.num_routed_experts, recipe.zero_expert_balance)
                  for router_logits, chosen in tap.outputs) / len(tap.outputs)
        loss = per_row.mean() + recipe.balance_loss_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        for router, (_, chosen) in zip(tap.routers, tap.outputs):
            steer_expert_bias(router, chosen, recipe.num_routed_experts, recipe.compute_target,
                              recipe.bias_update_rate)

        per_row = per_row.detach()
        for domain_index, domain in enumerate(DOMAINS):
            rows = domain_of_row == domain_index
            if rows.any():
                value = float(per_row[rows].mean())
                previous = domain_loss_ema[domain]
                domain_loss_ema[domain] = value if previous is None else 0.95 * previous + 0.05 * value
        aux_value = float(aux.detach())
        aux_loss_ema = aux_value if aux_loss_ema is None else 0.95 * aux_loss_ema + 0.05 * aux_value
        routed = float(sum((chosen < recipe.num_routed_experts).float().sum(dim=-1).mean()
                           for _, chosen in tap.outputs)) / len(tap.outputs)
        routed_ema = routed if routed_ema is None else 0.95 * routed_ema + 0.05 * routed
        progress.set_postfix(loss=f"{float(loss.detach()):.3f}", **{d: f"{v:.2f}" for d, v in domain_loss_ema.items()},
                             aux=f"{aux_loss_ema:.3f}", routed=f"{routed_ema:.2f}")
        if (step + 1) % 100 == 0 or step + 1 == recipe.steps:
            losses = " ".join(f"{d}={v:.3f}" for d, v in domain_loss_ema.items())
            progress.write(f"step {step + 1}/{recipe.steps} loss={float(loss.detach()):.3f} {losses} "
                           f"aux={aux_loss_ema:.3f} routed experts/token={routed_ema:.2f}")
    tap.close()
    progress.close()
    train_seconds = time.perf_counter() - started
    train_cpu_seconds = time.process_time() - cpu_started

    summary = {
        "command": command,
        "seed": seed,
        "threads": threads,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 1),
        "train_cpu_seconds": round(train_cpu_seconds, 1),
        "train_loss_ema": {d: round(v, 4) for d, v in domain_loss_ema.items()},
        "balance_loss_ema": round(aux_loss_ema, 4),
        "routed_experts_per_token_ema": round(routed_ema, 4),
        **evaluate_demo_model(model, tokenizer, recipe.eval_texts_per_domain, random_seed=seed),
        "python": ".".join(map(str, __import__("sys").version_info[:3])),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(model_card(summary))
    print(f"saved to {out} after {train_seconds:.0f} s; held-out loss "
          + " ".join(f"{d}={v:.3f}" for d, v in summary["held_out_loss"].items()))
    figures = summary["specialisation"]
    print("NMI(domain, top-1 expert) per layer: trained " + " ".join(f"{v:.3f}" for v in figures["trained_nmi"])
          + " | random " + " ".join(f"{v:.3f}" for v in figures["random_nmi"]))
    return summary


def compute_headline(compute: dict) -> str:
    """The field's claim, measured: 'prose used X%, math Y% ...; from position P on, Z%' (held-out text)."""
    domains = compute["domains"]
    used = ", ".join(f"{d} used {100 * v['active_fraction']:.1f}%" for d, v in domains.items())
    positions = compute["positions"]
    every = [v["active_fraction_by_position"] for v in domains.values()]
    tokens = [v["tokens"] for v in domains.values()]
    first, last = [], []
    for by_position, n in zip(every, tokens):
        if by_position[0] is not None and by_position[-1] is not None:
            first.append((by_position[0], n))
            last.append((by_position[-1], n))
    drift = ""
    if first:
        start = sum(v * n for v, n in first) / sum(n for _, n in first)
        end = sum(v * n for v, n in last) / sum(n for _, n in last)
        drift = (f"; the first {positions[1]} tokens of an input used {100 * start:.1f}%, "
                 f"tokens from position {positions[-1]} on {100 * end:.1f}%")
    return f"{used} of the parameters per token{drift}"


def model_card(summary: dict) -> str:
    """The demo model's README: data, size, seed, command, time, losses, compute and specialisation."""
    recipe = summary["recipe"]
    spec = summary["specialisation"]
    compute = summary["compute"]
    routed = recipe["num_routed_experts"]
    layer_rows = "\n".join(
        f"| {layer} | {trained:.3f} | {random:.3f} | "
        + ", ".join(f"{d} → {'zero ' + str(e - routed) if e >= routed else e} ({share:.0%})"
                    for d, (e, share) in spec["favourite_experts"][layer].items()) + " |"
        for layer, (trained, random) in enumerate(zip(spec["trained_nmi"], spec["random_nmi"])))
    loss_rows = "\n".join(f"| {d} | {summary['train_loss_ema'][d]:.3f} | {summary['held_out_loss'][d]:.3f} |"
                          for d in summary["held_out_loss"])
    positions = compute["positions"]
    buckets = [f"{lo}–{hi - 1}" for lo, hi in zip(positions[:-1], positions[1:])] + [f"{positions[-1]}+"]
    compute_rows = "\n".join(
        f"| {d} | {v['tokens']:,} | " + " / ".join(f"{x:.2f}" for x in v["routed_experts_per_layer"])
        + f" | {100 * v['active_fraction']:.2f}% | "
        + " | ".join("–" if x is None else f"{100 * x:.2f}%" for x in v["active_fraction_by_position"]) + " |"
        for d, v in compute["domains"].items())
    compute_header = ("| domain | tokens | routed experts per token, layer 0 / 1 / … | active fraction | "
                      + " | ".join("positions " + b for b in buckets) + " |\n|---|---|---|---|" + "---|" * len(buckets))
    return f"""# moescope demo model

A small `LongcatFlashForCausalLM` trained from scratch so the moescope demo can show real,
specialised routing without downloading anything, and a fraction of parameters per token that
really moves: its router picks {recipe['top_k']} of {routed} routed experts *and*
{recipe['zero_experts']} zero-computation (identity) experts, as LongCat-Flash does, so a token
that takes a zero expert runs fewer parameters. It is not a useful language model; it is a model
whose routers have learnt something worth watching.

**Measured on held-out text: {compute_headline(compute)}.**

## Model

- {recipe['num_layers']} LongCat-Flash layers (each: two MLA attention sublayers, two dense MLPs of \
{recipe['dense_intermediate_size']}, one MoE), hidden size {recipe['hidden_size']}, {routed} routed experts \
(intermediate size {recipe['expert_intermediate_size']}) and {recipe['zero_experts']} zero experts per MoE, \
top-{recipe['top_k']} routing, {recipe['num_attention_heads']} attention heads, tied input/output embeddings.
- {summary['parameters']:,} parameters, float32 safetensors; {compute['params_per_expert']:,} per routed
  expert, {compute['shared_params']:,} outside the routed experts (used by every token). LongCat's
  fused `gate_up_proj` has rows for the zero experts too, which no token ever reads: they count in
  the total and never as used.
- Tokenizer: byte-level BPE, {recipe['vocab_size']} tokens, trained with `tokenizers` on the first
  {recipe['tokenizer_chars_per_domain']:,} characters of each domain's training split; `<|endoftext|>` is
  bos, eos and pad. Saved as a `PreTrainedTokenizerFast`.

## Data

Three domains, all from Python {summary['python']} itself (see `moescope/demo_data.py`); every
fifth file, topic or operand pair is held out and never trained on:

- **code**: the standard library's top-level `*.py` modules, sorted by name;
- **prose**: the reference-manual topics in `pydoc_data.topics.topics`;
- **math**: generated lines like `37 + 58 = 95` (`+`, `-`, `*` on 0–99), seeded.

Each training row is {recipe['sequence_length']} tokens of one domain; every batch of {recipe['batch_size']} rows
takes the domains in turn.

## Training

```
{summary['command']}
```

Seed {summary['seed']}: `torch.manual_seed` for the weights, a seeded `torch.Generator` for the batch
order. {recipe['steps']} AdamW steps, peak learning rate {recipe['learning_rate']}
({recipe['router_lr_scale']}× that for the router weights), warm-up {recipe['warmup_steps']} steps then
cosine decay, gradient clipping 1.0.
Routing is trained the LongCat-Flash way at toy scale: after every step each routed expert's
selection bias moves by {recipe['bias_update_rate']} towards its share of a budget of
{recipe['compute_target']} routed experts per token (the bias changes which slots top-k picks, never the
gate weights), so the *average* compute is steered while each token may use more or fewer; a
load-balancing loss (coefficient {recipe['balance_loss_coef']}, zero experts weighted
{recipe['zero_expert_balance']} as in MoE++) keeps the routed experts in use. Routed experts per token at
the end of training (moving average): {summary['routed_experts_per_token_ema']:.2f} of {recipe['top_k']}.
Took **{summary['train_seconds']:.0f} s** of wall time and **{summary['train_cpu_seconds']:.0f} s of CPU
time** with {summary['threads']} torch thread(s) on a shared 2-core machine (torch {summary['torch']},
transformers {summary['transformers']}), tokenizer training included.

| domain | training loss (moving average) | held-out loss |
|---|---|---|
{loss_rows}

Losses are next-token cross-entropy in nats; held-out figures are on {spec['texts_per_domain']} held-out
texts per domain (`domain_texts(domain, {spec['texts_per_domain']}, seed=0)`).

## Parameters used per token

On the same held-out texts, with the probe's convention (every parameter outside the routed
experts, plus the routed experts the token used, over all parameters), measured by
`moescope.train_demo.compute_figures`; routed experts per token are per MoE layer (of
{recipe['top_k']}); the last columns split the active fraction by the token's position in its text.

{compute_header}
{compute_rows}

## Specialisation

Normalised mutual information between a token's domain and the choice its router ranks first
(a routed expert, or a zero expert), per layer, on the same held-out texts
({', '.join(f'{n:,} {d}' for d, n in spec['tokens_per_domain'].items())} tokens), against the same config
with random weights. Measured by `moescope.specialisation.measure_specialisation`; the last
column gives each domain's most chosen top-1 choice and the share of that domain's tokens it takes.

| layer | NMI trained | NMI random weights | favourite expert per domain |
|---|---|---|---|
{layer_rows}

A layer whose NMI stays near the random figure routes by something other than the domain (token
identity, position); a domain whose favourite is a zero expert skips that layer's experts for
most of its tokens. Both are worth seeing in the dashboard.
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m moescope.train_demo``."""
    parser = argparse.ArgumentParser(prog="python -m moescope.train_demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
