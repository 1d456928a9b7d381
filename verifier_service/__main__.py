"""python -m verifier_service --model DIR [--port 7001 ...]: see verifier_service/config.py for every flag."""

from verifier_service.server import main

if __name__ == "__main__":
    main()
