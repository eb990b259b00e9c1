from dflash_assets.app.cli import main

if __name__ == "__main__":
    main()
