"""Hydra's launcher `gpupool`: `python app.py -m ... hydra/launcher=gpupool` sends a multirun to a
gpupool pool as one array, one job per run, and brings each run's output directory back.

Hydra finds it by scanning the `hydra_plugins` namespace package (this folder has no
`hydra_plugins/__init__.py` on purpose: other distributions add their plugins beside it). The scan
imports every module here, so none imports gpupool's client or cloudpickle at the top: that waits for
a sweep to be launched."""
