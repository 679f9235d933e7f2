"""Downstream evaluation: lm-evaluation-harness on a run's exported Hugging Face model.

- :mod:`nobubble.downstream.scores`: the score files a run folder keeps (``downstream/``) and
  reading them back for ``nobubble report``; no optional package needed;
- :mod:`nobubble.downstream.harness`: task names, running lm-eval, its results as a score file
  (the only module that imports ``lm_eval``);
- :mod:`nobubble.downstream.cli`: ``nobubble eval``.

Not to be confused with :mod:`nobubble.evaluation`, the validation loss measured during training.
See docs/export.md, "Downstream evaluation".
"""
