"""The English prompts of tests/test_vllm_pd.py: a document and a question about it, each ending
inside a block once tokenized. ``PROMPTS["H"]`` is S1's document with another question, so its
leading blocks are S1's (the held-blocks case)."""

_DOCS = {
 "S1": "The old mill on the River Wend was built in 1796 to grind wheat for the villages along the valley. Its wheel, "
       "six metres across, was turned by water led from a weir half a mile upstream through a stone channel called "
       "the leat. In the busiest years the mill ran day and night through the autumn, and the miller's family lived in "
       "the rooms above the grinding floor. Steam mills in the towns took most of its trade after 1870, and by 1912 "
       "the wheel had stopped for good. The building stood empty for decades until a local trust bought it in 1978, "
       "repaired the roof, and rebuilt the wheel from oak using the original drawings, which had been found in a "
       "solicitor's archive. Today the mill grinds flour again on summer weekends, and visitors can buy it in paper "
       "bags printed with the same woodcut of the wheel that the miller used two hundred years ago.\n\n",
 "S2": "Honeybees communicate the location of food through a movement known as the waggle dance. A forager returning "
       "to the hive runs a short straight line across the vertical comb while shaking her abdomen from side to side, "
       "then loops back to repeat it. The angle of the straight run relative to vertical tells the other bees the "
       "direction of the flowers relative to the sun, and the length of the run tells them the distance: roughly one "
       "second of waggling for every kilometre of flight. Because the sun moves across the sky during the day, the "
       "dancers adjust the angle as the hours pass, even when they have been inside the dark hive for some time. "
       "The dance was decoded in the 1940s by the Austrian scientist Karl von Frisch, who shared a Nobel Prize for "
       "the work in 1973.\n\n",
 "S3": "class RingBuffer:\n"
       "    \"\"\"A fixed-size buffer that overwrites its oldest item when full.\"\"\"\n\n"
       "    def __init__(self, capacity):\n"
       "        if capacity <= 0:\n"
       "            raise ValueError(\"capacity must be positive\")\n"
       "        self.capacity = capacity\n"
       "        self.items = [None] * capacity\n"
       "        self.start = 0\n"
       "        self.size = 0\n\n"
       "    def push(self, item):\n"
       "        end = (self.start + self.size) % self.capacity\n"
       "        self.items[end] = item\n"
       "        if self.size == self.capacity:\n"
       "            self.start = (self.start + 1) % self.capacity\n"
       "        else:\n"
       "            self.size += 1\n\n"
       "    def to_list(self):\n"
       "        return [self.items[(self.start + i) % self.capacity] for i in range(self.size)]\n\n\n"
       "buf = RingBuffer(3)\n"
       "for value in [4, 8, 15, 16, 23]:\n"
       "    buf.push(value)\n"
       "print(buf.to_list())\n\n",
 "S4": "The city council met on Tuesday evening to discuss the plan for the new cycle lanes on Harbour Street. The "
       "proposal would remove forty parking spaces and add a protected lane in each direction, separated from traffic "
       "by a low concrete kerb. Shop owners on the street were divided: several said that their customers mostly "
       "arrive by car and that the loss of parking would hurt trade, while the owner of the bakery at the corner said "
       "that her busiest hours came from people walking and cycling to the station. A traffic survey commissioned by "
       "the council counted 1,850 cyclists on an average weekday, up from 900 five years ago. After two hours of "
       "debate the council voted seven to four to approve the plan, with construction expected to begin in March "
       "and to take about eleven weeks.\n\n",
 "C1": "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is buried and "
       "compressed, first into a grainy material called firn and then into dense blue ice. When the ice becomes thick "
       "enough, usually more than thirty metres, it begins to flow slowly downhill under its own weight. The speed "
       "varies enormously: some glaciers creep forward only a few centimetres a day, while others, especially those "
       "ending in the sea, can move more than ten metres a day. As they move, glaciers scrape and pluck rock from "
       "the ground beneath them, carving deep U-shaped valleys and leaving behind ridges of rubble called moraines "
       "when they retreat.\n\n",
 "C2": "Recipe for a simple lentil soup. Rinse two hundred grams of red lentils under cold water until the water runs "
       "clear. In a large pot, warm two tablespoons of olive oil over a medium heat and add one chopped onion, two "
       "diced carrots and a stick of celery. Cook them gently for about ten minutes, stirring now and then, until the "
       "onion is soft. Add two crushed cloves of garlic and a teaspoon of ground cumin and cook for one more minute. "
       "Tip in the lentils, a tin of chopped tomatoes and one litre of vegetable stock, bring the pot to the boil, "
       "then lower the heat and let it simmer for twenty-five minutes. Season with salt, pepper and a squeeze of "
       "lemon, and blend half of the soup if you prefer it thicker.\n\n",
 "C3": "The printing press developed by Johannes Gutenberg in Mainz around 1450 combined several existing ideas into "
       "one practical system. Metal type was cast in a hand mould, so that thousands of identical letters could be "
       "produced quickly; an oil-based ink stuck to the metal better than the water-based inks used for woodblocks; "
       "and a screw press, adapted from those used to make wine, pressed the paper evenly against the inked type. "
       "Gutenberg's most famous work, a Latin Bible of about 1,280 pages, was finished around 1455. Roughly 180 "
       "copies were printed, and 49 of them survive today, some on paper and some on vellum.\n\n",
 "C4": "Most modern passenger aircraft cruise at an altitude of between ten and twelve kilometres. At that height the "
       "air is thin, which reduces drag and lets the engines burn less fuel for each kilometre flown. The air outside "
       "is also very cold, often around minus fifty degrees Celsius, and far too thin to breathe, so the cabin is "
       "pressurised to the equivalent of an altitude of about two thousand metres. Pilots choose the exact cruising "
       "level according to the weight of the aircraft, the winds at different heights and instructions from air "
       "traffic control. As fuel is burned and the aircraft becomes lighter, it can climb to a higher level where it "
       "flies more efficiently.\n\n",
 "M":  "A lighthouse keeper's logbook from the winter of 1887 records eleven days in which no boat could reach the "
       "island. The storm began on the second of January with a wind from the south-west that the keeper described "
       "as strong enough to lift the gravel from the path. By the fourth, waves were breaking over the lantern "
       "gallery, forty metres above the sea, and one of the outer windows cracked. The keeper and his two assistants "
       "kept the light burning every night by climbing the tower in shifts of four hours, and they rationed their "
       "paraffin when it became clear the supply boat would be late. On the eleventh day the wind dropped, and the "
       "boat arrived the following morning carrying oil, flour, letters and a replacement pane of glass.\n\n",
 "K1": "A sourdough starter is a mixture of flour and water in which wild yeasts and lactic acid bacteria live "
       "together. To begin one, a baker mixes equal weights of wholemeal flour and water in a jar and leaves it at "
       "room temperature. Each day, most of the mixture is thrown away and the rest is fed with fresh flour and "
       "water. After about a week the starter should rise predictably, doubling in size within six to eight hours "
       "of a feed, and it should smell pleasantly sour rather than of nail varnish. Once established, a starter can "
       "be kept in the refrigerator and fed once a week.\n\n",
 "K2": "The game of chess is played on a board of sixty-four squares arranged in eight rows and eight columns. Each "
       "player begins with sixteen pieces: one king, one queen, two rooks, two bishops, two knights and eight pawns. "
       "The aim is to checkmate the opponent's king, which means attacking it in such a way that it has no legal move "
       "to escape. A game can also end in a draw, for example by stalemate, when the player to move has no legal "
       "moves but is not in check, or by agreement between the players.\n\n",
}
_QUESTIONS = {
 "S1": "Question: In which year did the mill's wheel stop for good?\nAnswer:",
 "S2": "Question: Who decoded the waggle dance?\nAnswer:",
 "S3": "Question: What does the print statement output?\nAnswer:",
 "S4": "Question: How did the council vote on the plan?\nAnswer:",
 "C1": "Question: What are the ridges of rubble left by glaciers called?\nAnswer:",
 "C2": "Question: How long should the soup simmer?\nAnswer:",
 "C3": "Question: How many copies of Gutenberg's Bible survive?\nAnswer:",
 "C4": "Question: To what altitude is the cabin pressurised?\nAnswer:",
 "M":  "Question: What did the supply boat carry?\nAnswer:",
 "K1": "Question: How often should an established starter be fed?\nAnswer:",
 "K2": "Question: How many pawns does each player begin with?\nAnswer:",
}
PROMPTS = {name: _DOCS[name] + _QUESTIONS[name] for name in _DOCS}
#: S1's document with another question: its leading blocks are S1's, already in daemon A
PROMPTS["H"] = _DOCS["S1"] + ("Question: According to the passage, which organisation bought the empty mill in "
                             "1978, and what did it repair first?\nAnswer:")
