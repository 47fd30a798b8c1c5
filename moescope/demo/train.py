"""Train the demo model: a small Mixtral whose experts really specialise, from text that ships with Python.

The newcomer's demo has to show real routing offline, so the repository carries a checkpoint
trained by this script on the three domains of :mod:`moescope.demo.data` (stdlib source code,
pydoc prose, generated arithmetic). Its experts have a capacity per sequence, as GShard and
Switch Transformer train theirs (:mod:`moescope.demo.capacity`): a token whose expert is full loses
that slot, so the share of the parameters a token uses varies with the token, the domain and
the position, and the demo can show it. Everything is decided by the seed: the tokenizer is trained
on a fixed slice of the corpus, the weights start from ``torch.manual_seed(seed)``, and the batch
order comes from a ``torch.Generator`` seeded the same way. The full run is sized to take a few
minutes on two CPU threads.

Run it as ``python -m moescope.demo.train`` (or ``moescope train-demo`` once the CLI wires
:func:`add_arguments` and :func:`run`). ``--quick`` trains a tiny model for a few steps, for tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time
from dataclasses import asdict, dataclass, field

import torch

from moescope.demo.data import DOMAINS, demo_model_path, domain_documents, domain_texts
from moescope.demo.model_card import model_card

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything besides the seed that decides the trained model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int
    # Switch Transformer uses 0.01. Under a capacity a lighter touch (0.005) leaves a domain that
    # is rare in the mix to crowd onto few experts, which is what makes its share of the
    # parameters differ (see rows_per_domain).
    router_aux_loss_coef: float
    # Slots per expert and sequence: ceil(capacity_factor * sequence length * k / experts), in
    # training and at inference (moescope.demo.capacity). 1.0 is GShard's and Switch's usual training factor.
    capacity_factor: float
    steps: int
    batch_size: int
    # Rows of each domain (in DOMAINS order) in every batch, summing to batch_size; None takes the
    # domains in turn (equal shares, give or take a row). The full recipe makes arithmetic rare
    # (1 row in 16): the batch-wide balancing loss then leaves it little room of its own, so its
    # sequences crowd a few experts and overflow them more than code and prose do.
    rows_per_domain: tuple[int, ...] | None
    sequence_length: int
    learning_rate: float
    # Routers learn slowly: only the relative weight of the chosen experts carries gradient back
    # to them. A higher rate for router weights (10x) lets domains find their experts within a
    # short run: middle-layer NMI 0.55 / 0.61 at 10x against 0.26 / 0.25 at 5x (digits split).
    router_lr_scale: float
    warmup_steps: int
    # Characters per domain the tokenizer learns from, so stdlib code (ten times the prose)
    # does not claim most of the vocabulary.
    tokenizer_chars_per_domain: int
    # Split numbers into single digits before BPE, as Llama's and Mistral's tokenizers do. Arithmetic
    # is then written with about sixteen symbols, so its sequences crowd few experts and overflow
    # their capacity more than code and prose do: the share of the parameters it uses differs.
    split_digits: bool
    # Cap on the code and prose corpora (files and topics, in order); size of the math corpus.
    max_documents: int | None
    math_documents: int
    # Held-out texts per domain for the final loss and the specialisation figures.
    eval_texts_per_domain: int
    # Held-out inputs of `sequence_length` tokens per domain for the active-fraction figures, and
    # the equal position buckets those figures are given in.
    profile_windows_per_domain: int
    position_buckets: int


FULL_RECIPE = DemoRecipe(
    vocab_size=2048, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    router_aux_loss_coef=0.005, capacity_factor=1.0, steps=1000, batch_size=16, rows_per_domain=(7, 8, 1),
    sequence_length=128, learning_rate=2e-3, router_lr_scale=10.0, warmup_steps=60,
    tokenizer_chars_per_domain=400_000, split_digits=True, max_documents=None, math_documents=2000,
    eval_texts_per_domain=60, profile_windows_per_domain=60, position_buckets=4,
)

QUICK_RECIPE = DemoRecipe(
    vocab_size=384, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    router_aux_loss_coef=0.005, capacity_factor=1.0, steps=4, batch_size=6, rows_per_domain=(2, 3, 1),
    sequence_length=32, learning_rate=2e-3, router_lr_scale=5.0, warmup_steps=1,
    tokenizer_chars_per_domain=20_000, split_digits=True, max_documents=3, math_documents=20,
    eval_texts_per_domain=4, profile_windows_per_domain=4, position_buckets=4,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train-demo`` options to `parser`."""
    parser.add_argument("--out", type=pathlib.Path, default=demo_model_path(),
                        help="folder to write the checkpoint, tokenizer and model card to "
                             "(default: the package's moescope/demo/model)")
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
    parts = ["python -m moescope.demo.train", f"--seed {args.seed}", f"--threads {args.threads}"]
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


def train_tokenizer(documents: dict[str, list[str]], vocab_size: int, chars_per_domain: int, split_digits: bool):
    """A byte-level BPE tokenizer learnt from the first `chars_per_domain` characters of each domain.

    Byte-level means every string round-trips exactly, whatever characters it holds. With
    `split_digits` every digit is a token of its own (no merge spans two digits), as in Llama's and
    Mistral's tokenizers. Returns a ``transformers.PreTrainedTokenizerFast`` whose bos, eos and pad
    token is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
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
                 generator: torch.Generator, rows_per_domain: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch: token windows and the index of each row's domain.

    Every batch holds the same mix of domains (`rows_per_domain` rows each, or the domains in turn
    when None), so the load-balancing loss cannot be met by giving each batch to one domain's
    experts. Each row is one domain only: the routing a row shows is that domain's routing.
    """
    rows, domain_of_row = [], []
    pattern = None if rows_per_domain is None else [d for d, n in enumerate(rows_per_domain) for _ in range(n)]
    for row in range(batch_size):
        domain_index = (step * batch_size + row) % len(DOMAINS) if pattern is None else pattern[row]
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
    """A freshly initialised ``MixtralForCausalLM`` of the recipe's shape, seeded with `seed`, with
    the recipe's expert capacity installed (its config records ``capacity_factor``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from moescope.demo.capacity import install_capacity

    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, num_local_experts=recipe.num_local_experts,
        num_experts_per_tok=recipe.num_experts_per_tok, max_position_embeddings=recipe.max_position_embeddings,
        router_aux_loss_coef=recipe.router_aux_loss_coef, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.capacity_factor = recipe.capacity_factor  # not a Mixtral field: the config keeps and saves it as one
    torch.manual_seed(seed)
    model = install_capacity(MixtralForCausalLM(config))
    # The grouped kernel runs the experts several times faster than the per-expert loop on CPU
    # and computes the same function; it is a runtime choice and is not saved with the config.
    model.set_experts_implementation("grouped_mm")
    return model


def build_optimizer(model, recipe: DemoRecipe) -> torch.optim.AdamW:
    """The recipe's AdamW: router weights in a group of their own at `router_lr_scale` times the
    learning rate (each group's ``lr_scale``; the loop sets ``lr`` from `learning_rate_at`)."""
    from moescope.demo.specialisation import router_modules

    router_weights = [router.weight for router in router_modules(model)]
    router_ids = {id(weight) for weight in router_weights}
    other_weights = [p for p in model.parameters() if id(p) not in router_ids]
    return torch.optim.AdamW([{"params": other_weights, "lr_scale": 1.0},
                              {"params": router_weights, "lr_scale": recipe.router_lr_scale}],
                             lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)


@torch.no_grad()
def held_out_losses(model, tokenizer, texts_per_domain: int, seed: int) -> dict[str, float]:
    """Mean next-token loss per domain on held-out texts (:func:`moescope.demo.data.domain_texts`)."""
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


@torch.no_grad()
def active_fraction_profile(model, tokenizer, windows_per_domain: int, length: int, buckets: int) -> dict:
    """The share of the parameters a token used, by domain and by position, on held-out inputs.

    Inputs: ``domain_windows(tokenizer, domain, windows_per_domain, length, seed=0)`` per domain
    (no padding); per-token fractions from :func:`moescope.demo.capacity.active_fraction_per_token`.
    Returns ``length``, ``windows_per_domain``, ``position_buckets`` ([start, end) pairs),
    ``dropless_fraction`` (every token keeping its k slots), ``shared_fraction`` (no slot kept),
    ``by_domain`` (mean over tokens), ``by_position`` (all domains, mean per bucket),
    ``by_domain_position`` and ``dropped_slot_share`` per domain (slots lost at capacity / chosen).
    """
    from moescope.demo.capacity import active_fraction_per_token, capacity_blocks
    from moescope.demo.data import domain_windows

    model.eval()
    blocks = capacity_blocks(model)
    total = sum(p.numel() for p in model.parameters())
    per_expert = [sum(p.numel() for p in b.experts.parameters()) // b.num_experts for b in blocks]
    shared = total - sum(n * b.num_experts for n, b in zip(per_expert, blocks))
    dropless = shared + sum(n * b.top_k for n, b in zip(per_expert, blocks))
    edges = [round(i * length / buckets) for i in range(buckets + 1)]
    per_domain = {}
    for domain in DOMAINS:
        rows = torch.tensor(domain_windows(tokenizer, domain, windows_per_domain, length, seed=0))
        per_domain[domain] = torch.cat([active_fraction_per_token(model, rows[i:i + 16])
                                        for i in range(0, len(rows), 16)])
    every = torch.cat(list(per_domain.values()))

    def by_bucket(fractions: torch.Tensor) -> list[float]:
        return [round(float(fractions[:, a:b].mean()), 5) for a, b in zip(edges, edges[1:])]

    # A dropped slot takes its expert's share away: (dropless - used) / (dropless - shared) of the k slots.
    return {
        "length": length, "windows_per_domain": windows_per_domain,
        "position_buckets": [[a, b] for a, b in zip(edges, edges[1:])],
        "dropless_fraction": round(dropless / total, 5), "shared_fraction": round(shared / total, 5),
        "by_domain": {d: round(float(f.mean()), 5) for d, f in per_domain.items()},
        "by_position": by_bucket(every),
        "by_domain_position": {d: by_bucket(f) for d, f in per_domain.items()},
        "dropped_slot_share": {d: round(float((dropless / total - f.mean()) / ((dropless - shared) / total)), 4)
                               for d, f in per_domain.items()},
    }


def evaluate_demo_model(model, tokenizer, texts_per_domain: int, random_seed: int = 0,
                        recipe: DemoRecipe | None = None) -> dict:
    """Held-out loss per domain, the specialisation figures and (given the `recipe`) the active
    fraction by domain and position, as the training summary stores them.

    Loss and specialisation use ``domain_texts(domain, texts_per_domain, seed=0)``; the
    random-weight baseline is seeded with `random_seed`; the active fraction is
    :func:`active_fraction_profile` on inputs of ``recipe.sequence_length`` tokens. Returns
    ``{"held_out_loss": ..., "specialisation": ..., "active_fraction": ...}``.
    """
    from moescope.demo.specialisation import measure_specialisation

    model.eval()
    held_out = held_out_losses(model, tokenizer, texts_per_domain, seed=0)
    texts = {domain: domain_texts(domain, texts_per_domain, seed=0) for domain in DOMAINS}
    report = measure_specialisation(model, tokenizer, texts, random_seed=random_seed)
    return {
        "held_out_loss": {d: round(v, 4) for d, v in held_out.items()},
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
        **({} if recipe is None else {"active_fraction": active_fraction_profile(
            model, tokenizer, recipe.profile_windows_per_domain, recipe.sequence_length, recipe.position_buckets)}),
    }


def train_demo_model(out: pathlib.Path, recipe: DemoRecipe = FULL_RECIPE, seed: int = 0, threads: int = 1,
                     command: str = "python -m moescope.demo.train") -> dict:
    """Train the demo model and write it, its tokenizer and a model card to `out`.

    Returns the training summary that is also written to ``out/training_summary.json``: the
    recipe, seed, wall time, final training and held-out losses per domain, and the
    specialisation figures (NMI per layer, trained and random weights). Raises ValueError for a
    recipe whose `rows_per_domain` does not fill a batch.
    """
    _check_recipe(recipe)
    torch.set_num_threads(threads)
    # The tokenizers library has its own thread pool; keep it within the same share of the CPU.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    started = time.perf_counter()
    # CPU time as well as wall time: on a shared machine the wall clock mostly measures the neighbours.
    cpu_started = time.process_time()

    documents = training_documents(recipe, seed)
    tokenizer = train_tokenizer(documents, recipe.vocab_size, recipe.tokenizer_chars_per_domain,
                                recipe.split_digits)
    tokenizer.model_max_length = recipe.max_position_embeddings
    streams = token_streams(tokenizer, documents)
    _check_streams(streams, recipe.sequence_length)
    model = build_model(recipe, tokenizer, seed)
    losses = _train_steps(model, streams, recipe, seed)
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
        "train_loss_ema": {d: round(v, 4) for d, v in losses.measured_domains().items()},
        "router_aux_loss_ema": round(losses.measured_aux(), 4),
        **evaluate_demo_model(model, tokenizer, recipe.eval_texts_per_domain, random_seed=seed, recipe=recipe),
        "python": ".".join(map(str, __import__("sys").version_info[:3])),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    _save(out, model, tokenizer, summary)
    _print_results(out, train_seconds, summary)
    return summary


def _check_recipe(recipe: DemoRecipe) -> None:
    """Raises ValueError unless `rows_per_domain` (when given) fills each batch with every domain's rows."""
    if recipe.rows_per_domain is not None and (len(recipe.rows_per_domain) != len(DOMAINS)
                                               or sum(recipe.rows_per_domain) != recipe.batch_size
                                               or min(recipe.rows_per_domain) < 0):
        raise ValueError(f"rows_per_domain must give a row count for each of {DOMAINS} summing to the batch size "
                         f"{recipe.batch_size}, got {recipe.rows_per_domain}")


@dataclass
class _LossAverages:
    """Exponential moving averages of the training loss per domain and of the load-balancing loss,
    for the progress bar and the card (None until a step has measured one)."""

    domains: dict[str, float | None] = field(default_factory=lambda: {domain: None for domain in DOMAINS})
    aux: float | None = None

    def update(self, per_row: torch.Tensor, domain_of_row: torch.Tensor, aux_loss: torch.Tensor) -> None:
        for domain_index, domain in enumerate(DOMAINS):
            rows = domain_of_row == domain_index
            if rows.any():
                value = float(per_row[rows].mean())
                previous = self.domains[domain]
                self.domains[domain] = value if previous is None else 0.95 * previous + 0.05 * value
        aux = float(aux_loss)
        self.aux = aux if self.aux is None else 0.95 * self.aux + 0.05 * aux

    def measured_domains(self) -> dict[str, float]:
        """Every domain's average; every step ran (--steps >= 1) and showed every domain's loss."""
        measured = {d: v for d, v in self.domains.items() if v is not None}
        assert len(measured) == len(self.domains)
        return measured

    def measured_aux(self) -> float:
        assert self.aux is not None  # every step ran (--steps >= 1)
        return self.aux


def _train_steps(model, streams: dict, recipe: DemoRecipe, seed: int) -> _LossAverages:
    """Run the recipe's optimizer steps on batches drawn with a generator seeded with `seed`, showing
    the losses on a progress bar (a line every 100 steps); returns their moving averages."""
    from tqdm.auto import tqdm

    model.train()
    optimizer = build_optimizer(model, recipe)
    generator = torch.Generator().manual_seed(seed)
    losses = _LossAverages()
    progress = tqdm(range(recipe.steps), desc="train-demo", unit="step")
    for step in progress:
        input_ids, domain_of_row = sample_batch(streams, step, recipe.batch_size, recipe.sequence_length, generator,
                                                recipe.rows_per_domain)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, recipe) * group["lr_scale"]
        outputs = model(input_ids=input_ids, output_router_logits=True)
        per_row = token_losses(outputs.logits, input_ids).mean(dim=1)
        loss = per_row.mean() + model.router_aux_loss_coef * outputs.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        losses.update(per_row.detach(), domain_of_row, outputs.aux_loss.detach())
        progress.set_postfix(loss=f"{float(loss.detach()):.3f}", **{d: f"{v:.2f}" for d, v in losses.domains.items()},
                             aux=f"{losses.aux:.3f}")
        if (step + 1) % 100 == 0 or step + 1 == recipe.steps:
            shown = " ".join(f"{d}={v:.3f}" for d, v in losses.domains.items())
            progress.write(f"step {step + 1}/{recipe.steps} loss={float(loss.detach()):.3f} {shown} "
                           f"aux={losses.aux:.3f}")
    progress.close()
    return losses


def _save(out: pathlib.Path, model, tokenizer, summary: dict) -> None:
    """The checkpoint, its tokenizer, the training summary and the model card, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(model_card(summary))


def _print_results(out: pathlib.Path, train_seconds: float, summary: dict) -> None:
    """Where the model went, its held-out losses, specialisation and active fraction, in three lines."""
    print(f"saved to {out} after {train_seconds:.0f} s; held-out loss "
          + " ".join(f"{d}={v:.3f}" for d, v in summary["held_out_loss"].items()))
    figures = summary["specialisation"]
    print("NMI(domain, top-1 expert) per layer: trained " + " ".join(f"{v:.3f}" for v in figures["trained_nmi"])
          + " | random " + " ".join(f"{v:.3f}" for v in figures["random_nmi"]))
    active = summary["active_fraction"]
    print("active fraction by domain: " + " ".join(f"{d}={v:.2%}" for d, v in active["by_domain"].items())
          + " | by position bucket: " + " ".join(f"{v:.2%}" for v in active["by_position"]))


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m moescope.demo.train``."""
    parser = argparse.ArgumentParser(prog="python -m moescope.demo.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
