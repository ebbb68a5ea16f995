"""Static attention settings: which implementation, and whether/how decode is sparse.

These are frozen (hashable) dataclasses: they are passed to jitted functions as static
arguments, so switching between the dense trainer and the sparse actor is a different
trace of the same model code, never an edit of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

IMPLS = ("auto", "xla", "pallas_tpu", "triton_gpu")
POLICIES = ("centroid", "quest", "streaming")


_LOWERING_PLATFORM: list[str] = []  # set by lowering_for(): the platform traced for


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace for `platform` instead of jax's backend, e.g. "tpu" on a CPU host, to lower the
    Pallas kernels with Mosaic: `with lowering_for("tpu"):
    jax.jit(f).trace(*shapes).lower(lowering_platforms=("tpu",))`. Trace a fresh function
    inside (jax caches traces, and this setting is not part of the cache key)."""
    _LOWERING_PLATFORM.append(platform)
    try:
        yield
    finally:
        _LOWERING_PLATFORM.pop()


def target_platform() -> str:
    """The platform code is traced for: lowering_for()'s, else jax's default backend."""
    return _LOWERING_PLATFORM[-1] if _LOWERING_PLATFORM else jax.default_backend()


def interpret_mode() -> bool:
    """Pallas TPU kernels compile with Mosaic on TPU and run interpreted elsewhere (read by
    the dispatcher in api.py and by the kernels in pallas_kernels/)."""
    return target_platform() != "tpu"


def min_candidate_groups(group_pages: int, budget: int, sink_pages: int, recent_pages: int):
    """Fewest candidate groups with which two-level selection reads every reserved page and
    can fill the budget: the groups the sink pages and the run of recent pages can span,
    plus whole groups for the other budget pages."""
    g = group_pages
    reserved_groups = -(-sink_pages // g) + (-(-(recent_pages - 1) // g) + 1)
    return reserved_groups + -(-(budget - sink_pages - recent_pages) // g)


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """Block-sparse decode: each step reads `budget` KV pages per (sequence, KV head).

    budget counts every page read, the reserved sink and recent pages included.
    budget_schedule: optional ((context_upper_bound, pages), ...) sorted by bound; the
    first bin whose bound is >= the context length gives the budget, past the last bin the
    last entry's pages apply (Sparrow's length-dependent budgets).
    group_pages: 0 selects the top pages among all of them (exact). G > 0: two-level
    selection, which reads O(pages / G + candidate_groups * G) summaries per step instead
    of O(pages): groups of G consecutive pages are scored from group summaries first, and
    the budget is filled from the pages of the candidate_groups best groups (those holding
    reserved pages among them). Equal to the flat selection while the candidates cover
    every page; past that an approximation of it (docs/benchmarks.md).
    gather_slices: the XLA decode step's page gather in this many independent slices (None:
    attention/sparse.py's GATHER_SLICES); the same values either way.
    """

    policy: str = "centroid"
    budget: int = 32
    budget_schedule: tuple[tuple[int, int], ...] = ()
    sink_pages: int = 1
    recent_pages: int = 2
    dense_layers: int = 2
    group_pages: int = 0
    candidate_groups: int = 16
    gather_slices: int | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"SparseSpec.policy must be one of {POLICIES}, got {self.policy!r}")
        reserved = self.sink_pages + self.recent_pages
        for pages in (self.budget, *(p for _, p in self.budget_schedule)):
            if pages < reserved:
                raise ValueError(
                    f"SparseSpec.budget ({pages}) must be >= sink_pages + recent_pages ({reserved})"
                )
        if self.recent_pages < 1:
            raise ValueError("SparseSpec.recent_pages must be >= 1 (the current page)")
        if self.dense_layers < 0:
            raise ValueError("SparseSpec.dense_layers must be >= 0")
        if self.group_pages < 0 or self.group_pages == 1:
            raise ValueError("SparseSpec.group_pages must be 0 (flat selection) or >= 2")
        if self.group_pages and self.policy == "streaming":
            raise ValueError("SparseSpec.group_pages applies to scored policies, not streaming")
        need = self.group_pages and min_candidate_groups(
            self.group_pages, self.max_pages, self.sink_pages, self.recent_pages
        )
        if self.candidate_groups < need:
            raise ValueError(
                f"SparseSpec.candidate_groups ({self.candidate_groups}) must be >= {need}: the "
                "groups that can hold reserved pages plus enough whole groups for the budget"
            )
        bounds = [b for b, _ in self.budget_schedule]
        if bounds != sorted(bounds):
            raise ValueError("SparseSpec.budget_schedule bounds must be increasing")

    @property
    def max_pages(self) -> int:
        """Static size of the page-id array: the largest budget any bin can ask for."""
        return max([self.budget, *(p for _, p in self.budget_schedule)])


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How attention is computed. sparse=None means dense everywhere."""

    impl: str = "xla"
    page_size: int = 16
    sparse: SparseSpec | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"AttentionSpec.impl must be one of {IMPLS}, got {self.impl!r}")
        if self.page_size <= 0:
            raise ValueError("AttentionSpec.page_size must be positive")

    def is_sparse_layer(self, layer: "LayerInfo") -> bool:
        """Sparse layers: global (no sliding window) layers past the first dense_layers."""
        return (
            self.sparse is not None
            and layer.window is None
            and layer.index >= self.sparse.dense_layers
        )

    def dense(self) -> "AttentionSpec":
        return dataclasses.replace(self, sparse=None)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What attention needs to know about one layer (static)."""

    index: int
    window: int | None  # sliding window in tokens, None for global layers
    softcap: float | None
    scale: float
