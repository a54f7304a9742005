"""The trial layer: what runs inside a trial process.

``TrialContext`` and the helpers that apply a config (``_context``, ``_knobs``), one rank of a DDP trial
(``_distributed``), the timed windows (``_measure``), the image loaders (``_images`` for torch, ``_dali`` for
NVIDIA DALI) and the process's entry point (``_execute``) with its compile clock (``_phase``). Nothing here
imports torch until a trial needs it, so the coordinator can import ``TrialSpec`` without it.
"""
