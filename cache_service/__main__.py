"""`python -m cache_service explain ...`"""

import sys

from cache_service.explain import main as explain_main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "explain":
        print("usage: python -m cache_service explain [options]  (see --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(explain_main(sys.argv[2:]))
