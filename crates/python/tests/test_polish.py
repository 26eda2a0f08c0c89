"""Small things of issue 51 from Python: an address without its port says so, and
``python -m ferry doctor | head`` ends quietly."""

import subprocess
import sys

import pytest

import ferry


def test_connect_to_an_address_without_a_port_says_the_port_is_missing():
    e = ferry.Engine()
    with pytest.raises(ferry.FerryError) as info:
        e.connect("127.0.0.1")
    said = str(info.value)
    assert "port" in said and "invalid socket address" not in said, said


def test_doctor_into_a_closed_pipe_ends_without_a_traceback():
    # `head -1` reads one line and closes the pipe.
    p = subprocess.run(f"{sys.executable} -m ferry doctor | head -1", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "{", p.stdout
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
