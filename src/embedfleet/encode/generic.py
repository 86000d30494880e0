"""Any other architecture, through transformers' AutoModel: pad the packed batch, run, unpad.

Slower than the packed paths (it computes padding) but never refuses a model that
sentence-transformers could load.
"""

from __future__ import annotations

import torch

from embedfleet.encode.models import missing_parameters, quiet_loading
from embedfleet.encode.packed.attention import Packing
from embedfleet.errors import ModelError


class GenericModel:
    causal = False

    def __init__(self, spec, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False):
        from transformers import AutoModel

        trust = {"trust_remote_code": True} if trust_remote_code else {}  # the model's own code (auto_map)
        try:
            with quiet_loading():
                try:
                    model, info = AutoModel.from_pretrained(str(spec.hf_dir), dtype=dtype, output_loading_info=True,
                                                            **trust)
                except TypeError:  # transformers < 4.56 spells it torch_dtype
                    model, info = AutoModel.from_pretrained(str(spec.hf_dir), torch_dtype=dtype,
                                                            output_loading_info=True, **trust)
        except Exception as err:
            raise ModelError(f"cannot load model {spec.path} with transformers: {err}".splitlines()[0]) from None
        missing = missing_parameters(info)
        if missing:  # vectors that would mean nothing
            raise ModelError(f"model {spec.path}: its weights lack {len(missing)} of the model's parameters "
                             f"({missing[0]}, …): not this config's trained weights, or saved incompletely")
        self.model = model.to(device).eval()
        self.hidden = int(spec.config.get("hidden_size") or spec.config.get("dim") or spec.config.get("d_model"))
        self.params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)

    def flops_per_token(self, mean_len: float) -> float:
        return 2 * self.params

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pk: Packing) -> torch.Tensor:
        n, length = pk.lengths.shape[0], pk.max_len
        seg, pos = pk.seg.long(), pk.pos.long()
        padded = ids.new_zeros(n, length)
        padded[seg, pos] = ids
        mask = (torch.arange(length, device=ids.device)[None, :] < pk.lengths[:, None]).long()
        return self._hidden(padded.long(), mask)[seg, pos]

    def _hidden(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[batch, length, hidden] states of a padded batch."""
        return self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state


class CustomModuleModel(GenericModel):
    """A model whose first sentence-transformers module is its own code (jina's `custom_st.Transformer`, with its
    task adapters): that module, loaded by sentence-transformers with trust_remote_code, gives the token embeddings
    of the padded batch, with `task` where it takes one; the pooling and the modules after it are embedfleet's."""

    def __init__(self, spec, device: torch.device, dtype: torch.dtype):
        try:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(str(spec.path), device=str(device), trust_remote_code=True)
        except Exception as err:
            raise ModelError(f"cannot load model {spec.path} with sentence-transformers: {err}".splitlines()[0]) from None
        self.module = st[0].to(dtype).eval()
        self.task: str | None = None  # set by the encoder: ModelSpec.task
        self.hidden = int(spec.config.get("hidden_size") or spec.config.get("dim") or spec.config.get("d_model"))
        self.params = sum(p.numel() for n, p in self.module.named_parameters() if "embed" not in n)

    def _hidden(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": input_ids, "attention_mask": mask}
        return self.module(features, **({"task": self.task} if self.task is not None else {}))["token_embeddings"]
