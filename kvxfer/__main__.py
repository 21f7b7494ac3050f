from kvxfer.cli import run

run()
