"""The search layer: deciding what to run.

Search spaces (``_space``), ``GuidedSampler`` (``_sampler``), the out-of-memory rule (``_rules``) and
replaying recorded tables (``_simulate``).
"""

from autotune.search._sampler import GuidedSampler
from autotune.search._simulate import ReplayTable, simulate
from autotune.search._space import SearchSpace, load_space

__all__ = ["GuidedSampler", "ReplayTable", "SearchSpace", "load_space", "simulate"]
