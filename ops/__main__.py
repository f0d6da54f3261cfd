"""`python -m ops`: the tokenmill CLI without the console script.

Same as running `tokenmill`.
"""

from ops.cli import main

main()
