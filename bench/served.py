"""The form a benchmark runs the model in: the verifier's own flags (``--dtype``, ``--weights``,
``--threads``) and its own choice, read from the cache folder where a verifier on this machine
stored it (``verifier_service.core.forms``). By default, what a verifier serves here."""

from __future__ import annotations

import argparse

import torch

from verifier_service.core.forms import Form, load_served
from verifier_service.core.model_loading import LoadedModel, cache_root


def add_form_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="as the verifier's (default: auto)")
    parser.add_argument("--weights", choices=["auto", "float", "int4", "int8"], default="auto", help="as the verifier's (default: auto)")
    parser.add_argument("--threads", type=int, default=0, help="as the verifier's (default: 0, measured)")


def load_form(model: str, dtype: str = "auto", weights: str = "auto", threads: int = 0) -> tuple[LoadedModel, Form]:
    """``model`` on the CPU in the form these flags give a verifier here (torch set to its threads)."""
    return load_served(model, torch.device("cpu"), dtype, weights, threads, folder=cache_root() / "forms")
