"""Device-dispatching ops: the only callers of `triton_kernels` and `cuda_ref` in the model path.

Each op picks an implementation per call from the tensors' device and `ASTRAI_ATTN_BACKEND`
(auto | torch | triton | cuda_ref); see `backend.py` and docs/kernels.md.
"""
