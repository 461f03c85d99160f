"""genrec.scripts."""
