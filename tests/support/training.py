"""A small Mixtral, its batches and raw reads of its training rows, for the training suites."""

from __future__ import annotations

import glob
import os

import pyarrow.parquet as pq
import torch
from transformers import MixtralConfig, MixtralForCausalLM

EXPERTS, TOP_K, VOCAB = 4, 2, 64


def tiny_mixtral(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           vocab_size=VOCAB, output_router_logits=True, router_aux_loss_coef=0.02)
    return MixtralForCausalLM(config)


def batches(n: int, batch: int = 2, seq: int = 12, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def rows(root, table: str):
    files = sorted(glob.glob(os.path.join(root, table, "*", "*.parquet")))
    assert files, f"no {table} files under {root}"
    return [r for f in files for r in pq.ParquetFile(f).read().to_pylist()]
