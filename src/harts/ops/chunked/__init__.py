"""What the chunked ops share: intra-chunk scores, the state scans, the decay gate, and the two
chunk layouts a call can run in (right-padded segments, or every node of a chunk tree).

A chunked op (:mod:`harts.ops.delta_rule`, :mod:`harts.ops.gated_linear_attention`) writes its
arithmetic once over :class:`ChunkedInputs` [..., C, .]; the layout cuts the tokens into chunks
(``inputs``), chains the chunks' affine state maps (``scan``) and puts the outputs back
(``outputs``), so the same arithmetic runs over segments (:class:`SegmentChunks`) and over a chunk
tree (:class:`TreeChunks`).
"""

from harts.ops.chunked.gate import gate_per_key, head_gate
from harts.ops.chunked.inputs import ChunkedInputs, chunked_inputs
from harts.ops.chunked.scan import StateScan, TreeStateScan
from harts.ops.chunked.scores import chunk_prefix_sum, exclusive_suffix_sum, intra_chunk_scores
from harts.ops.chunked.segments import SegmentChunks
from harts.ops.chunked.tree import TreeChunks

__all__ = [
    "ChunkedInputs",
    "SegmentChunks",
    "StateScan",
    "TreeChunks",
    "TreeStateScan",
    "chunk_prefix_sum",
    "chunked_inputs",
    "exclusive_suffix_sum",
    "gate_per_key",
    "head_gate",
    "intra_chunk_scores",
]
