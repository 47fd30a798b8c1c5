"""Small random-initialised models of every supported MoE family.

Tests, benchmarks and the first demo build their models here from `transformers` config classes,
so nothing is ever downloaded. Sizes are tiny on purpose; pass keyword overrides to grow them.
"""

from __future__ import annotations

from typing import Any

import torch

# family -> (config class, model class, config kwargs). The kwargs keep every model to a few
# hundred thousand parameters while still exercising each family's routing (shared experts,
# grouped top-k, capacity, dense layers between sparse ones).
_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16, num_key_value_heads=4,
        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
        n_group=1, topk_group=1, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, num_key_value_heads=4,
        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=4, topk_group=2,
        num_mtp_layers=0)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=16)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
        mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        _COMMON, intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=2, num_local_experts=8,
        num_experts_per_tok=1, head_dim=8, interleave_moe_layer_step=1, attention_chunk_size=64)),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 8,
                                                    "moe_top_k": 2})),
    "switch_transformers": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", dict(
        vocab_size=128, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=8, expert_capacity=4,
        decoder_start_token_id=0)),
}


def tiny_config(family: str, **overrides: Any):
    """The small config of a family; keyword overrides replace any default field."""
    import transformers

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    config_name, _, kwargs = FAMILIES[family]
    kwargs = {**kwargs, **overrides}
    if family == "dbrx" and "ffn_config" in overrides:
        kwargs["ffn_config"] = {**FAMILIES["dbrx"][2]["ffn_config"], **overrides["ffn_config"]}
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    return config


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-initialised model of `family`, in eval mode, on the CPU, seeded for repeatability."""
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config)
    return model.eval()
