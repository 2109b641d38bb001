"""Request strings, checkpoint names and tensor shapes: the checks that keep bad input away from
SQL, files and numpy."""

from __future__ import annotations

import pytest

from temper.common.checkpoints import check_name, parse_path
from temper.common.codec import decode_array
from temper.common.errors import InvalidArgument
from temper.common.strings import check_request_strings, shown
from temper.v1 import service_pb2, types_pb2


@pytest.mark.parametrize("request_", [
    service_pb2.GetInfoRequest(training_run_id="run\x00"),
    service_pb2.SaveWeightsRequest(training_run_id="r", name="final\n"),
    service_pb2.ListCheckpointsRequest(training_run_id="r" * 300),
    service_pb2.CreateSessionRequest(user_metadata={"k": "v\x00"}),
    service_pb2.CreateSessionRequest(user_metadata={"k\n": "v"}),
    service_pb2.CreateSessionRequest(tags=["x"] * 300),
    service_pb2.ForwardBackwardRequest(training_run_id="r", loss_fn="cross\x00entropy"),
])
def test_bad_strings_anywhere_in_a_request_are_refused(request_):
    with pytest.raises(InvalidArgument):
        check_request_strings(request_)


def test_good_strings_pass_and_free_text_may_hold_newlines():
    check_request_strings(service_pb2.CreateSessionRequest(tags=["a b", "line\nbreak"], user_metadata={"note": "x\ty"}))
    check_request_strings(service_pb2.SaveWeightsRequest(training_run_id="s:train:0", name="step-10.final"))


def test_checkpoint_names_match_whole_and_messages_stay_short():
    assert check_name("step-10") == "step-10"
    for bad in ("final\n", "a/b", ".hidden", "x" * 129):
        with pytest.raises(InvalidArgument):
            check_name(bad)
    with pytest.raises(InvalidArgument) as err:
        parse_path("tinker://" + "y" * 100_000)
    assert len(err.value.message) < 300
    assert len(shown("z" * 10_000)) < 100


def test_a_shape_whose_element_count_overflows_int64_is_refused():
    for shape in ([2**62, 4], [2**40, 2**40], [1] * 9):
        with pytest.raises(InvalidArgument):
            decode_array(types_pb2.Tensor(dtype=types_pb2.DTYPE_FLOAT32, shape=shape, data=b""))
