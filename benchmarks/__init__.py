"""Benchmarks (``tandem.bench``): ``tandem bench serve`` loads a running server over HTTP,
``tandem bench compare`` runs the offline engine against ``transformers`` and without speculation,
and ``python -m tandem.bench.gpu`` measures a GPU node."""
