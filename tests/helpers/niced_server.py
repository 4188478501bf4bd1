"""Imported first by the forkserver of `niced.warm_context`: lowers that server's priority to niced.NICE before
it imports anything heavy; the processes it forks inherit it."""

from __future__ import annotations

import os

from tests.helpers.niced import NICE

os.nice(NICE - os.nice(0))
