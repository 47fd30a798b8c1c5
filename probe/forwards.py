"""What a forward's own inputs and outputs say, read on the host without a device transfer: its
main input's token ids and (batch, sequence) shape, its kind (prefill or decode), and the bytes its
KV cache holds per attention layer.
"""

from __future__ import annotations

from typing import Any

import torch

from moescope.core.records import KVCacheLayer


def forward_kind(shape: tuple, decoder_shape: tuple) -> str | None:
    """"decode" when the forward feeds one token per sequence (a generation step over a KV cache),
    "prefill" when more, None when the shape is unknown. A window never mixes the two: its row's
    seq_len and per-token figures describe one kind of forward. An encoder-decoder's kind is its
    decoder's (the encoder runs on the first forward only)."""
    main = decoder_shape or shape
    if not main:
        return None
    return "decode" if main[1] == 1 else "prefill"


def main_input(inputs: dict[str, Any], decoder: bool) -> tuple[torch.Tensor | None, tuple]:
    """The forward's token ids (when given as ids) and its (batch, sequence) shape."""
    names = ("decoder_input_ids", "decoder_inputs_embeds") if decoder else ("input_ids", "inputs_embeds")
    for name in names:
        value = inputs.get(name)
        if isinstance(value, torch.Tensor):
            ids = value if name.endswith("input_ids") else None
            return ids, tuple(value.shape[:2]) if value.dim() >= 2 else (1, value.shape[0])
    return None, ()


def kv_cache_layers(output: Any) -> list[KVCacheLayer] | None:
    """Bytes held by the KV cache per attention layer, from the cache the forward returned.

    Reads only tensor shapes and dtypes on the host: no device transfer.
    """
    cache = getattr(output, "past_key_values", None)
    if cache is None and isinstance(output, dict):
        cache = output.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    result = []
    for index, cache_layer in enumerate(layers):
        tensors = [v for v in vars(cache_layer).values() if isinstance(v, torch.Tensor)]
        keys = getattr(cache_layer, "keys", None)
        seq_len = int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else 0
        result.append(KVCacheLayer(layer=index, bytes=sum(t.numel() * t.element_size() for t in tensors),
                                   seq_len=seq_len))
    return result
