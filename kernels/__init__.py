"""Triton kernels of dpara_rt, each beside its torch reference (dispatch: dpara_rt.ops).

tree_attention  spine + branch tree-mask attention for the DPara backbone forward
markov_head     fused Markov head: boundary logits + rank-R bias, arg-max or Gumbel-max, d steps
verify          greedy and lossless rejection-sampling verification
Triton itself is optional and imported on the first Triton launch only (see triton_support.py).
"""
