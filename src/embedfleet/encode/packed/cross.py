"""A BERT or XLM-R cross-encoder (a sequence-classification head) on the packed BERT pass: each (query, text) pair
tokenized together as transformers tokenizes it, the pairs packed without padding, their token types kept, one
row of logits a pair from the head transformers' model for that family puts on its first token."""

from __future__ import annotations

import torch

from embedfleet.encode.models import BERT_TYPES
from embedfleet.encode.packed import strip_prefix
from embedfleet.encode.packed.attention import Packing, token_layout
from embedfleet.encode.packed.bert import PackedBert

__all__ = ["PackedCrossEncoder"]


class PackedCrossEncoder:
    def __init__(self, bert: PackedBert, head: dict, roberta: bool):
        self.bert, self.head, self.roberta = bert, head, roberta

    @classmethod
    def create(cls, cfg: dict, state: dict, device, dtype) -> PackedCrossEncoder | None:
        """None where the model is not a BERT-family sequence classifier this pass computes."""
        if cfg.get("model_type") not in BERT_TYPES:
            return None
        bert = PackedBert.create(cfg, state, device, dtype, compile=False)
        if bert is None:
            return None

        def t(x):
            return x.to(device=device, dtype=dtype).contiguous()

        if "classifier.out_proj.weight" in state:  # RobertaForSequenceClassification: dense, tanh, out_proj
            head = {"dense_w": t(state["classifier.dense.weight"]), "dense_b": t(state["classifier.dense.bias"]),
                    "out_w": t(state["classifier.out_proj.weight"]), "out_b": t(state["classifier.out_proj.bias"])}
            return cls(bert, head, roberta=True)
        encoder = strip_prefix(state, "embeddings.word_embeddings.weight")
        if "classifier.weight" not in state or "pooler.dense.weight" not in encoder:
            return None
        head = {"dense_w": t(encoder["pooler.dense.weight"]), "dense_b": t(encoder["pooler.dense.bias"]),
                "out_w": t(state["classifier.weight"]), "out_b": t(state["classifier.bias"])}
        return cls(bert, head, roberta=False)  # BertForSequenceClassification: the pooler, then the classifier

    def logits(self, ids: list[list[int]], types: list[list[int]] | None) -> torch.Tensor:
        """[pairs, labels] float32 logits of tokenized pairs (their ids, and token types where the tokenizer gives
        them)."""
        dev = self.head["out_w"].device
        lengths = torch.tensor([len(x) for x in ids], dtype=torch.int32, device=dev)
        total = int(lengths.sum())
        flat = torch.tensor([i for x in ids for i in x], dtype=torch.int32, device=dev)
        cu, seg, pos = token_layout(lengths, total)
        pk = Packing(cu=cu, max_len=int(lengths.max()), seg=seg, pos=pos, lengths=lengths)
        tt = torch.tensor([i for x in types for i in x], dtype=torch.int32, device=dev) if types else None
        with torch.inference_mode():
            first = self.bert(flat, pk, tt).index_select(0, cu[:-1])  # [CLS] / <s> of each pair
            h = self.head
            pooled = torch.tanh(torch.nn.functional.linear(first, h["dense_w"], h["dense_b"]))
            return torch.nn.functional.linear(pooled, h["out_w"], h["out_b"]).float()
