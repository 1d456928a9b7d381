"""python -m drafter_service --model DIR [--port 7002 ...]: see drafter_service/config.py for every flag."""

from drafter_service.server import main

if __name__ == "__main__":
    main()
