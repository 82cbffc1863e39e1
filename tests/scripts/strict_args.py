import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
print(parser.parse_args())
