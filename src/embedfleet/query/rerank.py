"""Reranking: a cross-encoder (a sentence-transformers CrossEncoder directory or hub id) scores each (query, row)
pair, and the search's first `--rerank-depth` rows are put in the order of those scores.

A BERT or XLM-R classifier runs on embedfleet's packed BERT pass (`encode.packed.cross`); any other through
transformers' AutoModelForSequenceClassification. Both as sentence-transformers' CrossEncoder runs it: pairs
tokenized together (truncated to the model's limit), one logit a pair, the CrossEncoder's activation on it (sigmoid
for a one-label model unless its config names another).
"""

from __future__ import annotations

import numpy as np

from embedfleet.errors import ModelError

__all__ = ["Reranker", "RERANK_DEPTH"]

RERANK_DEPTH = 50  # rows a reranked search scores (the search's first; k of them come back)
BATCH = 32
PACKED_BATCH = 256  # pairs a packed pass takes at once (no padding: tokens, not the longest pair, cost)


def activation(path, cfg, model: str):
    """The activation a CrossEncoder puts on its logits, where sentence-transformers finds it: its own config
    (`config_sentence_transformers.json`, since 6), config.json's `sentence_transformers` entry, or the key
    before 4 (`sbert_ce_default_activation_function`); else sigmoid for one label, none for more."""
    import json

    import torch

    own = path / "config_sentence_transformers.json"
    named = json.loads(own.read_text()).get("activation_fn") if own.is_file() else None
    named = (named or (getattr(cfg, "sentence_transformers", None) or {}).get("activation_fn")
             or getattr(cfg, "sbert_ce_default_activation_function", None))
    if named is None:
        return torch.sigmoid if cfg.num_labels == 1 else (lambda x: x)
    kind = named.rsplit(".", 1)[-1]
    if not named.startswith("torch.nn.") or not isinstance(getattr(torch.nn, kind, None), type):
        raise ModelError(f"--rerank {model}: its activation {named} is not one of torch.nn's; embedfleet applies "
                         "only those")
    return getattr(torch.nn, kind)()


class Reranker:
    """`path`: "packed" (a BERT/XLM-R classifier on embedfleet's packed BERT pass: pairs without padding) or
    "generic" (transformers' AutoModelForSequenceClassification, padded)."""

    def __init__(self, model: str, device: str = "cpu", trust_remote_code: bool = False):
        import torch
        from transformers import AutoConfig, AutoTokenizer

        from embedfleet.encode.models import missing_parameters, position_limit, quiet_loading, resolve_model

        path = resolve_model(model, flag="--rerank")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelError(f"--rerank {model}: not a cross-encoder transformers can load "
                             f"({str(e).splitlines()[0]})") from None
        self.name, self.device = str(model), device
        self.packed = None if trust_remote_code else _packed(path, cfg, torch.device(device))
        self.path = "packed" if self.packed is not None else "generic"
        if self.packed is None:
            from transformers import AutoModelForSequenceClassification

            try:
                with quiet_loading():
                    loaded, info = AutoModelForSequenceClassification.from_pretrained(
                        str(path), trust_remote_code=trust_remote_code, output_loading_info=True)
            except (OSError, ValueError) as e:
                raise ModelError(f"--rerank {model}: not a cross-encoder transformers can load "
                                 f"({str(e).splitlines()[0]})") from None
            missing = missing_parameters(info)
            if missing:  # random weights where the file has none: scores that order nothing
                raise ModelError(f"--rerank {model}: its weights lack {len(missing)} of the model's parameters "
                                 f"({missing[0]}, …): not a trained cross-encoder")
            self.model = loaded.to(device).eval()
        limit = position_limit(cfg.to_dict())
        told = getattr(self.tokenizer, "model_max_length", limit)
        self.max_length = min(limit, told if isinstance(told, int) and told < 1_000_000 else limit, 512)
        self._activation = activation(path, cfg, model)
        self._torch = torch

    def scores(self, query: str, texts: list[str]) -> np.ndarray:
        """One score a text, for the pair (query, text): the higher, the more relevant."""
        torch = self._torch
        out = []
        step = BATCH if self.packed is None else PACKED_BATCH
        with torch.inference_mode():
            for a in range(0, len(texts), step):
                part = texts[a:a + step]
                if self.packed is not None:
                    enc = self.tokenizer([query] * len(part), part, truncation=True, max_length=self.max_length)
                    logits = self.packed.logits(enc["input_ids"], enc.get("token_type_ids"))
                else:
                    enc = self.tokenizer([query] * len(part), part, padding=True, truncation=True,
                                         max_length=self.max_length, return_tensors="pt").to(self.device)
                    logits = self.model(**enc).logits.float()
                logits = logits[:, 0] if logits.shape[1] == 1 else logits.max(1).values
                out.append(self._activation(logits).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def rerank(self, query: str, rows: list[dict], k: int) -> list[dict]:
        """The k rows that score best, best first, each with its `rerank_score`."""
        scores = self.scores(query, [str(r["content"]) for r in rows])
        for r, s in zip(rows, scores.tolist()):
            r["rerank_score"] = s
        return sorted(rows, key=lambda r: -r["rerank_score"])[:k]


def _packed(path, cfg, device):
    """The packed cross-encoder for a BERT/XLM-R sequence classifier stored as safetensors, else None."""
    from embedfleet.encode.packed import load_state
    from embedfleet.encode.packed.cross import PackedCrossEncoder

    if not any(a.endswith("ForSequenceClassification") for a in getattr(cfg, "architectures", None) or []):
        return None
    state = load_state(path)
    if state is None:
        return None
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return PackedCrossEncoder.create(cfg.to_dict(), state, device, dtype)
    except KeyError as e:  # a parameter the file does not hold
        raise ModelError(f"--rerank {path}: its weights lack {e.args[0]}, …: not a trained cross-encoder") from None
