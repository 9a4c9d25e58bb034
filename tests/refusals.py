"""The one check every refusal test makes: a DFlashError of one line holding the needles."""

import pytest

from dflash_mlx.errors import DFlashError


def refused(call, *needles) -> str:
    """Call ``call``; assert it raises a one-line DFlashError containing every needle.

    Returns:
        the message.
    """
    with pytest.raises(DFlashError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg
