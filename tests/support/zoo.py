"""Small random-initialised models of every supported MoE family.

Tests, benchmarks and the first demo build their models here from `transformers` config classes,
so nothing is ever downloaded. Sizes are tiny on purpose (about 50-100k parameters, a forward in
well under a second on a CPU); pass keyword overrides to grow them.

The families are the text MoE models of `transformers` 5.24 that build from a small config;
`docs/families.md` lists them with how the probe reads each one, and the families left out and why.
"""

from __future__ import annotations

from typing import Any

import torch

# family -> (config class, model class, config kwargs). The kwargs keep every model to a few
# hundred thousand parameters while still exercising each family's routing (shared experts,
# grouped top-k, capacity, dense layers between sparse ones).
_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128)

# DeepSeek-V3.2 and GLM-MoE-DSA share their shape: MLA with an indexer ("sparse attention").
_SPARSE_INDEXED = dict(
    vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
    intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
    q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8,
    index_n_heads=2, layer_types=['indexed_attention', 'indexed_attention'], mlp_layer_types=['sparse', 'sparse'],
    pad_token_id=0)

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
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 8, "moe_top_k": 2})),
    "switch_transformers": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", dict(
        vocab_size=128, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=8, expert_capacity=4,
        decoder_start_token_id=0)),
    # Encoder-decoder, top-2 under a capacity that eval mode sizes to the batch: 0.2 of 21 tokens
    # -> 5 slots per expert, so some second choices are dropped.
    "nllb_moe": ("NllbMoeConfig", "NllbMoeForConditionalGeneration", dict(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=48, decoder_ffn_dim=48,
        encoder_attention_heads=4, decoder_attention_heads=4, num_experts=8, expert_capacity=4,
        encoder_sparse_step=2, decoder_sparse_step=2, moe_eval_capacity_token_fraction=0.2,
        max_position_embeddings=128, pad_token_id=1, decoder_start_token_id=2)),
    # The rest route like Mixtral as far as the probe is concerned (the experts module gets the final
    # ids and weights), whatever their attention (MLA, linear, Mamba, sliding windows) or shared experts.
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=0, sliding_window=16,
        layer_types=['sliding_attention', 'full_attention'])),
    "aria": ("AriaTextConfig", "AriaTextForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, moe_num_experts=8, moe_topk=2,
        moe_num_shared_experts=1)),
    "axk1": ("AXK1Config", "AXK1ForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mlp_layer_types=['sparse', 'sparse'], pad_token_id=0)),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
        layer_types=['indexed_attention', 'indexed_attention'], mlp_layer_types=['sparse', 'sparse'], pad_token_id=0)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
        moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_token=2,
        num_shared_experts=1, topk_group=1, num_expert_group=1, first_k_dense_replace=0, kv_lora_rank=16,
        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, layer_group_size=2,
        layer_types=['linear_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'], pad_token_id=0)),
    "beam": ("BeamConfig", "BeamForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, sliding_window=16, layer_types=['sliding_attention',
        'full_attention'], mlp_layer_types=['sparse', 'sparse'])),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, sliding_window=16, layer_types=['sliding_attention', 'full_attention'],
        mlp_layer_types=['sparse', 'sparse'])),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", _SPARSE_INDEXED),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, sliding_window=16,
        layer_types=['full_attention', 'full_attention'])),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, moe_num_experts=8, moe_k=2,
        moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_end_index=1)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
        sliding_window=16, layer_types=['sliding_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'])),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, pad_token_id=0)),
    "flint": ("FlintConfig", "FlintForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_tok=2, sliding_window=16, mlp_only_layers=[],
        decoder_sparse_step=1, layer_types=['full_attention', 'sliding_attention'])),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, mlp_layer_types=['sparse', 'sparse'], pad_token_id=0)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", _SPARSE_INDEXED),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, shared_intermediate_size=24, layer_types=['full_attention', 'sliding_attention'])),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, mamba_d_state=4,
        mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, shared_intermediate_size=24,
        layer_types=['mamba', 'attention'])),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        shared_intermediate_size=24)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, num_experts=8, moe_topk=2)),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, mlp_layer_types=['sparse', 'sparse'])),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
        layer_types=['indexed_attention', 'indexed_attention'], mlp_layer_types=['sparse', 'sparse'], pad_token_id=0)),
    # Mixture of attention heads (MoA) and of MLPs (MoE), each with its own router, grouped gating.
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, kv_channels=8)),
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(
        _COMMON, moe_intermediate_size=24, shared_expert_intermediate_size=24, num_hidden_layers=2, head_dim=8,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=16, layer_types=['sliding_attention',
        'full_attention'])),
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_tok=2, sliding_window=16,
        layer_types=['full_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'])),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", dict(
        _COMMON, moe_intermediate_size=24, shared_expert_intermediate_size=24, num_hidden_layers=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, sliding_window=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=['linear_attention', 'sliding_attention'])),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, num_dense_layers=0, layer_types=['conv', 'full_attention'])),
    # Zero (identity) experts: the router chooses among 8 routed + 2 zero experts.
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
        head_dim=8, n_routed_experts=8, moe_topk=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, expert_ffn_hidden_size=24, zero_expert_num=2, pad_token_id=0, num_layers=2,
        ffn_hidden_size=48)),
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=16, layer_types=['full_attention', 'full_attention'],
        mlp_layer_types=['sparse', 'sparse'])),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, v_head_dim=8, sliding_window=16, layer_types=['full_attention',
        'sliding_attention'], mlp_layer_types=['sparse', 'sparse'])),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, layer_types=['full_attention', 'linear_attention'])),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2)),
    "minimax_m3_vl": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", dict(
        _COMMON, intermediate_size=48, num_hidden_layers=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        index_head_dim=8, index_n_heads=2, shared_intermediate_size=24, dense_intermediate_size=48,
        layer_types=['full_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'])),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        _COMMON, moe_intermediate_size=24, shared_expert_intermediate_size=24, num_hidden_layers=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=['linear_attention', 'full_attention'])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_tok=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mlp_only_layers=[],
        decoder_sparse_step=1, layer_types=['linear_attention', 'full_attention'])),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(
        _COMMON, moe_intermediate_size=24, num_hidden_layers=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1)),
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


def tiny_model(family: str, seed: int = 0, correction_bias: float | None = None, **overrides: Any) -> torch.nn.Module:
    """A random-initialised model of `family`, in eval mode, on the CPU, seeded for repeatability.

    correction_bias: for families with an `e_score_correction_bias` (DeepSeek-V3 style), fill it with
    a shuffled ramp over [-correction_bias, correction_bias], so the experts chosen are not a top-k of
    the scores; the probe must record what the experts really got. Other overrides are the config's.
    """
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config)
    if correction_bias is not None:
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                ramp = torch.linspace(-correction_bias, correction_bias, buffer.numel())
                buffer.copy_(ramp[torch.randperm(buffer.numel())])
    return model.eval()


# A small Mixtral as the training tests take it: 4 experts, top-2, in train mode.
TRAINING_MIXTRAL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=64)


def training_mixtral(seed: int = 0, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`TRAINING_MIXTRAL`, random-initialised from `seed`, in train mode; with a dtype (float64 for
    exact optimizer arithmetic), cast to it and run with the eager experts (the grouped-mm kernels
    take no float64)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**TRAINING_MIXTRAL)).train()
    if dtype is not None:
        model = model.to(dtype)
        model.set_experts_implementation("eager")
    return model
