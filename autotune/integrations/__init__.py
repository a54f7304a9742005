"""The integrations layer: tuning the trainers people already use.

``autotune.integrations.transformers`` tunes a Hugging Face ``transformers.Trainer`` job and
``autotune.integrations.lightning`` a Lightning ``Trainer`` job. Each maps a trial's ``TrialConfig`` onto
the trainer's own arguments, measures the trainer's steps on the trial's clock (``ctx.step_clock``) from
a callback, and gives the best config back as arguments to paste. ``_common`` holds what both share.

Nothing here imports ``transformers`` or ``lightning`` until a function needs it; a missing library is a
``MissingExtraError`` that names the extra (``pip install 'autotune[transformers]'``).
"""
