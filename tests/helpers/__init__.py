"""In-memory test doubles for the seams in dilocox_p2p (see shared/STYLE.md rule 9)."""
