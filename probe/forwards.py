"""What a forward's own inputs and outputs say, read on the host without a device transfer: its
main input's token ids and (batch, sequence) shape, its kind (prefill or decode), and the bytes its
KV cache holds per attention layer.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    layers = getattr(returned_cache(output), "layers", None)
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


CACHE_NAMES = ("cache", "past_key_values")  # transformers' current name first, then the one before it


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned (None when it returned none): `cache` where transformers names
    it so, `past_key_values` where an older release does. A model output is read by its own keys,
    so transformers' deprecated `past_key_values` alias, which logs a deprecation warning in the
    user's output, is never touched."""
    if isinstance(output, Mapping):  # a ModelOutput is an OrderedDict of its non-None fields
        keys = output.keys()
        return next((output[name] for name in CACHE_NAMES if name in keys), None)
    return next((value for name in CACHE_NAMES if (value := getattr(output, name, None)) is not None), None)
