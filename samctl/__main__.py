from samctl.cli import main

main()
