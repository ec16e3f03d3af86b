#!/usr/bin/env python
"""Django's command-line utility; `apiary` (apiary_site.cli) is the friendlier front door."""

import sys

from apiary_site.cli import main

if __name__ == "__main__":
    main(sys.argv, prog_is_manage=True)
