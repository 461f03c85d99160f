"""genrec.scripts: the thin user-facing programs (the `genrec` command line).

Parses arguments and calls library code; a script longer than ~150 lines is hiding a
library function. The top floor: may import every `genrec` package.
"""
