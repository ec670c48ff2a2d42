"""fake_next_agent: stands in for the next release of the node agent, one whose capture format is
newer than this one's and which still reads this one's (``IMAGE_FORMATS_READ`` of that release). A
test starts ``dynsnap agent`` with this directory first on its PYTHONPATH and
DYNSNAP_FAKE_NEXT_IMAGE_FORMAT set: Python imports this module at start-up, before any of dynsnap's,
and it moves the two constants as the next release's source would. Nothing else differs: the agent
is this checkout's, so what the test shows is that the reading of an older capture works.

Not collected by pytest (no ``test_`` prefix).
"""

import os

_next = os.environ.get("DYNSNAP_FAKE_NEXT_IMAGE_FORMAT")
if _next:
    from dynsnap.models import protocol as _P

    _old = _P.IMAGE_FORMAT
    _P.IMAGE_FORMAT = int(_next)  # type: ignore[misc]
    _P.IMAGE_FORMATS_READ = frozenset({*_P.IMAGE_FORMATS_READ, int(_next)})  # type: ignore[misc]
    assert _old in _P.IMAGE_FORMATS_READ
