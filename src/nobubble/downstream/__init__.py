"""Downstream evaluation: lm-evaluation-harness on a run's exported Hugging Face model.

- :mod:`nobubble.downstream.harness`: task names, running lm-eval, its results as a score file
  (the only module that imports ``lm_eval``);
- :mod:`nobubble.downstream.cli`: ``nobubble eval``.

The score files it writes into a run folder (``downstream/``) are
:mod:`nobubble.runfolder.scores`, in the run folder's package below both this package and
``nobubble report``, which reads them back.

Not to be confused with :mod:`nobubble.evaluation`, the validation loss measured during training.
See docs/export.md, "Downstream evaluation".
"""
