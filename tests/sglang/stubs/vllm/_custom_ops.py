"""``rotary_embedding`` as vLLM's custom op defines it, written with torch ops."""
import torch


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Rotates ``query`` and ``key`` in place (shape ``[tokens, heads * head_size]`` or
    ``[tokens, heads, head_size]``) by the rows of ``cos_sin_cache`` (``[positions,
    rotary_dim]``, cosines then sines) at ``positions``; only the first ``rotary_dim``
    dimensions of each head turn. ``is_neox``: the two halves of the rotary part pair up;
    otherwise adjacent dimensions pair up."""
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(positions.numel(), -1, head_size)
        rot = heads[..., : cos.shape[-1] * 2]
        c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
        if is_neox:
            rot.copy_(torch.cat((r1, r2), dim=-1))
        else:
            rot.copy_(torch.stack((r1, r2), dim=-1).flatten(-2))
