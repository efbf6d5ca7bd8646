"""SamplingParams validation: every bad input raises, and the message names the field."""

import math

import numpy as np
import pytest

from dijax.runtime.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.ignore_eos, p.seed) == (1.0, 0, 1.0, 16, False, None)
    assert p.stop_token_ids == () and p.stop == ()
    q = SamplingParams(temperature=0, top_k=np.int64(5), top_p=1, max_tokens=3, stop_token_ids=[7, 8],
                       stop=["\n"], seed=np.int32(4))
    assert q.greedy and isinstance(q.temperature, float) and q.temperature == 0.0
    assert type(q.top_k) is int and q.top_k == 5 and type(q.seed) is int
    assert q.stop_token_ids == (7, 8) and q.stop == ("\n",)


def test_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": "1"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": 1.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "3"}, "top_k"),
    ({"top_p": "0.5"}, "top_p"),
    ({"top_p": False}, "top_p"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop": "end"}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "7"}, "seed"),
])
def test_wrong_type_raises_type_error(kwargs, field):
    with pytest.raises(TypeError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
])
def test_bad_value_raises_value_error(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


def test_message_states_allowed_range():
    with pytest.raises(ValueError, match=r"SamplingParams.top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
