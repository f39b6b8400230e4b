"""The adversarial review of issue 37's sharding: tests/multidevice/review.py on 8 fake CPU devices."""

from processes import pytest_on_fake_devices


def test_review_on_eight_fake_devices():
    """tests/multidevice/review.py under 8 fake CPU devices, in its own process."""
    code, report = pytest_on_fake_devices("tests/multidevice/review.py")
    assert code == 0, report
