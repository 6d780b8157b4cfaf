"""The study's runner for a framework: the one module that knows both (:mod:`kq.study_jax` and :mod:`kq.study_mlx`
build on :mod:`kq.study`, which imports neither)."""

from __future__ import annotations

from kq.study import StudyConfig


def make_study(config: StudyConfig):
    """The study's runner for ``config.framework``: :class:`kq.study_jax.JaxStudy` or :class:`kq.study_mlx.MlxStudy`
    (each framework imported only when asked for)."""
    if config.framework == "jax":
        from kq.study_jax import JaxStudy

        return JaxStudy(config)
    from kq.study_mlx import MlxStudy

    return MlxStudy(config)
