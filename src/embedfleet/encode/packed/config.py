"""ModernBERT's and Gemma3's config.json read as transformers' own config classes read them, without importing
transformers: importing a config class pulls in most of transformers (and torch.distributed, torch._dynamo),
seconds of a first call that the weights do not need.

Each reader fills in what an older or newer config.json leaves out: the layer types (from the period of global
layers), the RoPE base of each layer type (from the legacy keys), and the window.
"""

from __future__ import annotations

from types import SimpleNamespace

from embedfleet.errors import ModelError

__all__ = ["gemma3_config", "modernbert_config"]


def _layer_rope(cfg: dict, global_theta: float, local_theta: float, scaled_kinds: tuple[str, ...]) -> dict:
    """{"full_attention": {...}, "sliding_attention": {...}}: the config's own `rope_parameters`, a legacy
    `rope_scaling` merged into the `scaled_kinds`, each type's base where the config gives none."""
    given = cfg.get("rope_parameters") or {}  # a flat set (not by layer type) is not read, as transformers does
    params = {kind: dict(given[kind] if isinstance(given.get(kind), dict) else {"rope_type": "default"})
              for kind in ("full_attention", "sliding_attention")}
    for kind in scaled_kinds:
        params[kind].update(cfg.get("rope_scaling") or {})
    params["full_attention"].setdefault("rope_theta", global_theta)
    params["sliding_attention"].setdefault("rope_theta", local_theta)
    for p in params.values():
        p.setdefault("rope_type", p.get("type", "default"))
    return params


def _layer_types(cfg: dict, layers: int, local) -> list[str]:
    """The config's `layer_types`, else each layer's from `local(i)`; one a layer, or a one-line ModelError."""
    types = cfg.get("layer_types") or ["sliding_attention" if local(i) else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelError(f"config.json: {len(types)} layer_types for {layers} layers (num_hidden_layers)")
    return list(types)


def modernbert_config(cfg: dict) -> SimpleNamespace:
    layers = int(cfg.get("num_hidden_layers", 22))
    every = int(cfg.get("global_attn_every_n_layers", 3))
    # each side of a token: half the window (a `sliding_window` key sets that half itself, as transformers' setter)
    side = int(cfg["sliding_window"]) if cfg.get("sliding_window") else int(cfg.get("local_attention", 128)) // 2
    return SimpleNamespace(
        hidden_size=int(cfg.get("hidden_size", 768)), num_hidden_layers=layers,
        num_attention_heads=int(cfg.get("num_attention_heads", 12)),
        hidden_activation=cfg.get("hidden_activation", "gelu"), norm_eps=float(cfg.get("norm_eps", 1e-5)),
        layer_types=_layer_types(cfg, layers, lambda i: i % every), sliding_window=side,
        rope_parameters=_layer_rope(cfg, float(cfg.get("global_rope_theta", 160_000.0)),
                                    float(cfg.get("local_rope_theta", 10_000.0)), ("full_attention", "sliding_attention")))


def gemma3_config(cfg: dict) -> SimpleNamespace:
    layers = int(cfg.get("num_hidden_layers", 26))
    every = int(cfg.get("sliding_window_pattern", 6))
    bidirectional = bool(cfg.get("use_bidirectional_attention") or False)
    window = cfg.get("sliding_window", 4096)  # None: the local layers see every token
    return SimpleNamespace(
        hidden_size=int(cfg.get("hidden_size", 2304)), num_hidden_layers=layers,
        num_attention_heads=int(cfg.get("num_attention_heads", 8)),
        num_key_value_heads=int(cfg.get("num_key_value_heads", 4)), head_dim=int(cfg.get("head_dim", 256)),
        hidden_activation=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"), use_bidirectional_attention=bidirectional,
        layer_types=_layer_types(cfg, layers, lambda i: (i + 1) % every),
        # exclusive, as transformers keeps it: a bidirectional window reaches half its width each side
        sliding_window=None if window is None else int(window) // 2 + 1 if bidirectional else int(window),
        rope_parameters=_layer_rope(cfg, float(cfg.get("rope_theta", 1_000_000.0)),
                                    float(cfg.get("rope_local_base_freq", 10_000.0)), ("full_attention",)))
