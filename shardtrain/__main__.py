from shardtrain.cli.app import run

run()
