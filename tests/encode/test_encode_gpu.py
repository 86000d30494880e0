"""GPU checks of the packed encoder: bf16 vectors close to sentence-transformers' float32 ones."""

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MINILM = Path(os.environ.get("EMBEDFLEET_GPU_MINILM", ".models/all-MiniLM-L6-v2-fp16"))


def _st(path, texts, prompt=None):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cuda").encode(texts, normalize_embeddings=True, prompt_name=prompt)


def _texts():
    from embedfleet.synth import review_texts

    return review_texts(300, seed=3) + ["word " * 1000, "a"]


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
def test_minilm_bf16_matches_st():
    from embedfleet.encode.encoder import Encoder

    enc = Encoder(str(MINILM))
    assert enc.describe()["path"] == "packed" and enc.describe()["dtype"] == "bfloat16"
    ours = enc.encode(_texts())
    assert ((ours * _st(MINILM, _texts())).sum(1)).min() >= 0.999


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
def test_a_gpu_encoder_starts_its_helpers_and_its_calls_use_them():
    """On a GPU the constructor starts the tokenizer's helpers (one thread tokenizing is slower than the
    device); calls use them once up, with the vectors of an encoder that tokenizes in-process."""
    import numpy as np

    from embedfleet.encode.encoder import Encoder
    from embedfleet.synth import world_texts

    texts = world_texts(6000, seed=5)
    with Encoder(str(MINILM)) as enc:
        assert enc._tok.workers == 0 or enc._tok.pool_started
        if not enc._tok.workers:
            pytest.skip("fewer than 4 cores: no helpers")
        enc._tok.start()  # wait until they are up
        pooled = enc.encode(texts)
        assert enc._tok.pooled > 0
    alone = Encoder(str(MINILM), tokenizer_workers=0).encode(texts)
    np.testing.assert_allclose(pooled, alone, atol=2e-3)


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
def test_warmup_leaves_no_compiling_for_the_first_units():
    """torch.compile compiles again for a second token count (automatic dynamic shapes): warm-up pays
    for that too, so that a job's first units, of other sizes, find every graph ready."""
    from torch._dynamo.utils import counters

    from embedfleet.encode.encoder import Encoder

    enc = Encoder(str(MINILM))
    enc.warmup()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the counter is kept (this process compiled at least the warm-up's graphs)
    for n in (5, 700, 3000):
        enc.encode(["a review of yet another length, " * (1 + i % 40) for i in range(n)])
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_a_pooling_that_leaves_the_prompt_out_matches_st_on_the_gpu(tmp_path, mode):
    """`include_prompt: false` on the device: the prompt's tokens weighted out of the packed mean (or the CLS moved
    past them) for every batch, as sentence-transformers pools them."""
    import json

    from sentence_transformers import SentenceTransformer, models

    from embedfleet.encode.encoder import Encoder

    st = SentenceTransformer(str(MINILM), device="cpu")
    path = tmp_path / "noprompt"
    SentenceTransformer(modules=[st[0], models.Pooling(384, pooling_mode=mode, include_prompt=False), st[2]],
                        device="cpu").save(str(path))
    cfg = json.loads((path / "config_sentence_transformers.json").read_text())
    cfg["prompts"] = {"query": "Represent the question for retrieving reviews: "}
    (path / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    ours = Encoder(str(path)).encode(_texts(), prompt="query")
    assert ((ours * _st(path, _texts(), prompt="query")).sum(1)).min() >= 0.999


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_tiny_qwen3_varlen_matches_st(tmp_path, pooling):
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("qwen3-0.6b", tmp_path, tiny=True, pooling=pooling)
    enc = Encoder(str(path), dtype="bfloat16")
    assert enc.model._kernel is not None  # the Triton q/k norm + RoPE kernel is what runs here
    for prompt in (None, "query"):
        ours = enc.encode(_texts(), prompt=prompt)
        assert ((ours * _st(path, _texts(), prompt)).sum(1)).min() >= 0.999


def test_flash_window_attention_matches_the_band_masked_reference():
    """FlashAttention's varlen window against the reference path's band mask (float32), on sequences longer and
    shorter than the window, with peaked scores (where the window decides what a token sees)."""
    from embedfleet.encode.packed.attention import Packing, _padded_sdpa, attention, token_layout

    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.tensor([1, 7, 40, 300, 129], dtype=torch.int32, device="cuda")
    total = int(lengths.sum())
    cu, seg, pos = token_layout(lengths, total)
    pk = Packing(cu=cu, max_len=300, seg=seg, pos=pos, lengths=lengths)
    q, k, v = (torch.randn(total, 4, 64, device="cuda", generator=g) for _ in range(3))
    for window in (4, 64):
        ours = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pk, causal=False, window=window)
        ref = _padded_sdpa(q, k, v, pk, False, None, window)
        full = _padded_sdpa(q, k, v, pk, False, None, None)
        assert (ours.float() - ref).abs().max() < 0.1 < (full - ref).abs().max()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_modernbert_packed_matches_st_on_cuda(tmp_path, pooling):
    """ModernBERT's packed path in bf16 on CUDA (FlashAttention, its window on the local layers) against
    sentence-transformers."""
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("modernbert-base", tmp_path, tiny=True, pooling=pooling)
    enc = Encoder(str(path), dtype="bfloat16")
    assert enc.path == "packed"
    texts = _texts() + ["a sentence about chargers, cables and screens " * 12]
    assert ((enc.encode(texts) * _st(path, texts)).sum(1)).min() >= 0.999


@pytest.mark.parametrize("pooling", ["mean", "lasttoken"])
def test_tiny_gemma3_packed_matches_st_on_cuda(tmp_path, pooling):
    """EmbeddingGemma's layout (bidirectional Gemma3, GQA, q/k norms, local layers' window) on CUDA, on the packed
    path: in float32 the vectors sentence-transformers makes in float32; in bf16 close to those it makes in bf16,
    and as close to the float32 ones as its own bf16 vectors are."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("gemma3-300m", tmp_path, tiny=True, pooling=pooling)
    texts = _texts() + ["a sentence about chargers, cables and screens " * 12]

    def st(dtype):
        out = SentenceTransformer(str(path), device="cuda", model_kwargs={"torch_dtype": dtype}).encode(
            texts, convert_to_tensor=True).float().cpu().numpy()
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def ours(dtype):
        enc = Encoder(str(path), dtype=dtype)
        assert enc.path == "packed"
        return enc.encode(texts)

    ref32, ref16 = st(torch.float32), st(torch.bfloat16)
    assert (ours("float32") * ref32).sum(1).min() >= 0.9999
    got16 = ours("bfloat16")
    # bf16 rounds in another order than transformers' ops (fused kernels): near its bf16, and as near the float32
    # vectors as its bf16 is (a last-token pooling keeps one token's rounding, the most sensitive)
    assert (got16 * ref16).sum(1).min() >= 0.98 and (got16 * ref16).sum(1).mean() >= 0.995
    assert (got16 * ref32).sum(1).min() >= (ref16 * ref32).sum(1).min() - 0.01


def test_tiny_nomic_bert_packed_matches_st_on_cuda(tmp_path):
    """NomicBert on CUDA on the packed path: float32 equals sentence-transformers' float32, bf16 its bf16."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("nomic-embed-v1.5", tmp_path, tiny=True)
    texts = _texts()
    for dtype, tol in ((torch.float32, 0.9999), (torch.bfloat16, 0.995)):
        enc = Encoder(str(path), dtype=str(dtype).removeprefix("torch."))
        assert enc.path == "packed"
        st = SentenceTransformer(str(path), device="cuda", model_kwargs={"torch_dtype": dtype}).encode(
            texts, convert_to_tensor=True, prompt_name="document").float()
        st = (st / st.norm(dim=1, keepdim=True)).cpu().numpy()
        assert (enc.encode(texts, prompt="document") * st).sum(1).min() >= tol


def test_budget_probe_fits_memory(tmp_path):
    from embedfleet.encode.budget import max_batch_tokens
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    enc = Encoder(str(build_random_model("minilm-l6", tmp_path, tiny=True)))
    assert enc.max_seq_length <= enc.budget.tokens <= max_batch_tokens(enc.model.hidden)


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_kernel_matches_the_torch_path(norm):
    """The Triton kernel against the torch code it replaces, on strided QKV rows as the matmul gives them."""
    from embedfleet.encode.packed.kernels import qk_norm_rope
    from embedfleet.encode.packed.qwen3 import _qk_norm_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv, d, n = 16, 8, 128, 3001
    qkv = torch.randn(n, (heads + 2 * kv) * d, device="cuda", generator=g).bfloat16().view(n, heads + 2 * kv, d)
    w = (torch.rand(heads + kv, d, device="cuda", generator=g) + 0.5).bfloat16() if norm else None
    ang = torch.rand(512, 1, d // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    pos = torch.randint(0, 512, (n,), device="cuda", generator=g, dtype=torch.int32)
    ours = qk_norm_rope(qkv, heads + kv, w, cos, sin, pos, 1e-6)
    ref = _qk_norm_rope(qkv.float(), w.float() if norm else None, cos.float()[pos.long()], sin.float()[pos.long()],
                        heads + kv, 1e-6)
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["layer", "rms", "post"])
def test_add_norm_kernel_matches_torch(kind):
    """The residual add and the norm after it, in one kernel, against torch's ops in float32: LayerNorm with a
    bias (ModernBERT), RMSNorm (Gemma3's pre-norm), and Gemma3's post-norm of the branch before the add."""
    import torch.nn.functional as F

    from embedfleet.encode.packed.kernels import add_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    n, width = 3001, 768
    x, y = (torch.randn(n, width, device="cuda", generator=g).bfloat16() for _ in range(2))
    w, b, post = (torch.rand(width, device="cuda", generator=g) + 0.5 for _ in range(3))
    summed, normed = add_norm(x, y, w.bfloat16() if kind == "layer" else w, b.bfloat16() if kind == "layer" else None,
                              1e-6, rms=kind != "layer", post_w=post if kind == "post" else None)
    branch = F.rms_norm(y.float(), (width,), eps=1e-6) * post if kind == "post" else y.float()
    ref_sum = x.float() + branch
    ref = (F.layer_norm(ref_sum, (width,), w, b, 1e-6) if kind == "layer"
           else F.rms_norm(ref_sum, (width,), eps=1e-6) * w)
    torch.testing.assert_close(summed.float(), ref_sum, atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(normed.float(), ref, atol=6e-2, rtol=3e-2)
    _, alone = add_norm(x, None, w, None, 1e-6, rms=True)
    torch.testing.assert_close(alone.float(), F.rms_norm(x.float(), (width,), eps=1e-6) * w, atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_gated_act_kernel_matches_torch(act):
    import torch.nn.functional as F

    from embedfleet.encode.packed.kernels import gated_act

    fn = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "relu": F.relu}[act]
    h = torch.randn(2999, 2 * 1152, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    a, gate = h.float().chunk(2, dim=-1)
    torch.testing.assert_close(gated_act(h, act).float(), fn(a) * gate, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", ["modernbert-base", "gemma3-300m"])
def test_glue_kernels_replace_the_compile_and_match_the_torch_glue(tmp_path, shape, monkeypatch):
    """ModernBERT and Gemma3 on CUDA in bf16 run their glue in Triton kernels once these are loaded (on a thread,
    the torch glue meanwhile), with nothing left to compile; their vectors are the torch glue's (EMBEDFLEET_TRITON=0,
    which compiles instead)."""
    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model(shape, tmp_path, tiny=True)
    texts = _texts()
    enc = Encoder(str(path), dtype="bfloat16")
    before = enc.encode(texts)  # the kernels may still be loading: the torch glue, uncompiled
    assert enc.model.kernels_loaded.wait(300) and enc.model.kernels is not None
    assert enc.describe()["compile"] == "off"
    ours = enc.encode(texts)
    assert (ours * before).sum(1).min() >= 0.995
    monkeypatch.setenv("EMBEDFLEET_TRITON", "0")
    plain = Encoder(str(path), dtype="bfloat16")
    assert plain.model.kernels is None and plain.describe()["compile"] == "waiting"
    assert (ours * plain.encode(texts)).sum(1).min() >= 0.995


@pytest.mark.skipif(not MINILM.is_dir(), reason="fp16 MiniLM not prepared (.models/)")
def test_a_first_call_on_cuda_runs_flash_attention_without_importing_dynamo():
    """FlashAttention through torch's aten op: a fresh process's first encode on CUDA imports no
    torch._dynamo (the varlen wrapper's import made it wait ~4 s), and its vectors match ST's."""
    import json
    import subprocess
    import sys

    code = f"""
import json, sys, traceback
who = []
class Spy:  # on failure, the stack that imported torch._dynamo
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and not who:
            who.append("".join(traceback.format_stack(limit=25)))
sys.meta_path.insert(0, Spy())
from embedfleet.encode.encoder import Encoder
from embedfleet.encode.packed import attention
from embedfleet.synth import world_texts
texts = world_texts(500, seed=5)
enc = Encoder({str(MINILM)!r})
vectors = enc.encode(texts)
import numpy as np
np.save(sys.argv[1], vectors)
print(who[0] if who else "", file=sys.stderr)
print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "flash": attention._flash_op() is not None}}))
"""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"first-call-{os.getpid()}.npy"
    p = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "flash": True}, p.stderr[-4000:]
    import numpy as np

    from embedfleet.synth import world_texts

    ours = np.load(out)
    out.unlink()
    assert (ours * _st(MINILM, world_texts(500, seed=5))).sum(1).min() >= 0.999


def test_tiny_mistral_packed_matches_st_on_cuda(tmp_path):
    import json

    from embedfleet.encode.encoder import Encoder
    from embedfleet.encode.shapes import build_random_model

    path = build_random_model("qwen3-0.6b", tmp_path, tiny=True, model_type="mistral")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096, "architectures": ["MistralModel"]}))
    enc = Encoder(str(path), dtype="bfloat16")
    assert enc.path == "packed"
    for prompt in (None, "query"):
        ours = enc.encode(_texts(), prompt=prompt)
        assert ((ours * _st(path, _texts(), prompt)).sum(1)).min() >= 0.999
