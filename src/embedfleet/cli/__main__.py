from embedfleet.cli import main

main()
