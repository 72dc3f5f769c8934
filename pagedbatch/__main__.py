from pagedbatch.cli import main

if __name__ == "__main__":  # not when a multiprocessing child imports this module
    raise SystemExit(main())
