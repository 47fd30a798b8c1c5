"""What the probe reads from a forward's output: the KV cache, by transformers' current name."""

from __future__ import annotations

import torch
import transformers.utils.generic

from moescope.probe.forwards import kv_cache_layers, returned_cache
from tests.support.zoo import tiny_model


def _cache_bytes(cache) -> list[int]:
    """Bytes per attention layer, read off the cache transformers built (its keys and values)."""
    return [layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in cache.layers]


def test_the_cache_is_read_without_the_deprecated_alias(monkeypatch):
    """Issue 33, part 9: reading `output.past_key_values` logs transformers' "`past_key_values`/
    `cache_params` are deprecated" into the demo's output; the probe reads the output's own keys."""
    warned: list[str] = []
    monkeypatch.setattr(transformers.utils.generic.logger, "warning_once",
                        lambda message, *args, **kwargs: warned.append(message))
    model = tiny_model("mixtral")
    with torch.no_grad():
        output = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True)
    cache = output["cache"] if "cache" in output.keys() else output["past_key_values"]
    layers = kv_cache_layers(output)
    assert warned == []
    assert [layer.bytes for layer in layers] == _cache_bytes(cache)
    assert [layer.seq_len for layer in layers] == [5] * len(cache.layers)


def test_the_cache_under_either_name_or_none():
    cache = object()
    assert returned_cache({"past_key_values": cache}) is cache  # a release before the rename
    assert returned_cache({"cache": cache, "logits": None}) is cache
    assert returned_cache((torch.zeros(1),)) is None  # return_dict=False: a tuple, no names
    assert kv_cache_layers({"logits": torch.zeros(1)}) is None
