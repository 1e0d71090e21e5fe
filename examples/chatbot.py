"""The README's main job from a checkout: ``python examples/chatbot.py [--quick ...]``.

The simulation lives in ``tierkv.demo`` so that an installed package runs it too, as ``tierkv demo``;
this file stays so the command in the README and in older notes keeps working.
"""

from tierkv.demo import main

if __name__ == "__main__":
    main()
