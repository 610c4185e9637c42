"""Hand-written replies for every built-in persona: some that follow it, some that drift.

Replies answer the persona's probe the way a chat model plausibly would. `graded=True`
marks measures whose scores are shares of something (sentiment mass, slang words, plural
nouns, ...) where a faithful reply does not reach 1 or a drifted one stays well above 0;
for those the tests check ordering with `margin` instead of the 0.8 / 0.2 thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    compliant: tuple[str, ...]
    violating: tuple[str, ...]
    graded: bool = False
    margin: float = 0.2


def case(compliant: list[str], violating: list[str], graded: bool = False, margin: float = 0.2) -> Case:
    return Case(tuple(compliant), tuple(violating), graded, margin)


# A typical drifted answer to "What do you do in London as a tourist?".
PLAIN = (
    "As a tourist in London, I would start with the British Museum, then walk along the South Bank "
    "to see the Houses of Parliament. In the evening, I would catch a show in the West End."
)
PLAIN_SHORT = "In London, I'd visit the British Museum and take a boat trip on the Thames."

LONG_REPLY = " ".join(
    [
        "Thank you so much for asking, I am doing wonderfully well today, and I would love to tell you all about it in great detail.",
        "This morning began with a slow, quiet cup of coffee by the window, watching the light creep across the rooftops while the city woke up around me.",
        "After that I spent a long while reading, first a chapter of a history of the Roman roads of Britain and then a handful of essays about gardening,",
        "which led me down a winding path of thinking about how people have always shaped the land they live on, from terraces on hillsides to tiny balcony pots.",
        "Around midday I went for a walk along the river, where the water was high after the rain, and I counted eleven herons standing perfectly still in the shallows.",
        "I stopped at a small bakery that sells the most remarkable cardamom buns, soft and fragrant, and I ate two of them on a bench while watching the boats go by.",
        "The afternoon was given over to a long conversation with an old friend about music, memory, and the strange way a single song can carry you back twenty years.",
        "We talked about the first concerts we ever attended, the records we wore out, and the teachers who pushed us to practise scales when we wanted to play anything else.",
        "Later I cooked a big pot of vegetable soup, chopping carrots, leeks, celery and potatoes, and let it simmer for hours so the whole flat smelled warm and comforting.",
        "In the evening I wrote letters, real paper letters, to three relatives who live far away, telling them about the herons, the buns, the soup and the long talk.",
        "So, all things considered, I am well, rested, content and a little sleepy, and I hope that your own day has been every bit as full and pleasant as mine has been.",
        "Now tell me everything about how you are, because I would genuinely enjoy hearing every last detail of it, however small or ordinary it may seem to you.",
    ]
)


CASES: dict[str, Case] = {
    # ------------------------------------------------------------------ pattern
    "start-words-with-a": case(
        ["Admire amazing architecture, amble along avenues, and attend an awesome art auction!"],
        [
            "In London, tourists usually visit the British Museum, ride the Tube, and watch the Changing of the Guard."
        ],
    ),
    "start-words-with-z": case(
        ["Zoom zealously, zigzagging zestfully: zoos, zany zones, zebra zebra-crossings!"],
        [PLAIN_SHORT],
    ),
    "no-letter-e": case(
        [
            "As a tourist in London, I'd look at a big clock, stroll by a long canal, and munch fish and chips in a pub."
        ],
        [PLAIN],
    ),
    "alliteration": case(
        ["Stroll south, see St Paul's, sample sandwiches, stop somewhere splendid, sip strong stout."],
        [PLAIN],
        graded=True,  # ordinary English already has ~20% of words on its most common initial
    ),
    "one-sentence": case(
        [
            "As a tourist in London, I would visit the British Museum and then take a boat trip along the Thames."
        ],
        [
            PLAIN,
            "Great question! First, visit the Tower of London. Then have tea at a cafe. Finally, see a musical.",
        ],
    ),
    "all-caps": case(
        [
            "AS A TOURIST IN LONDON, I VISIT THE BRITISH MUSEUM, WALK ALONG THE THAMES AND SEE A SHOW IN THE WEST END!"
        ],
        [PLAIN],
    ),
    "all-lowercase": case(
        [
            "as a tourist in london, i'd visit the british museum, walk along the thames and grab a pint in a cosy pub."
        ],
        [PLAIN, "As A Tourist In London, I Would Visit The Tower Bridge And Big Ben."],
        # share of letters in lower case, as the original: sentence case is still about 0.95
        graded=True,
        margin=0.05,
    ),
    "answer-as-questions": case(
        [
            "Have you considered the British Museum? Why not take a boat along the Thames? "
            "Wouldn't a West End show be the perfect end to the day?"
        ],
        [PLAIN],
    ),
    "no-letters": case(
        ["🏛️ + 🎡 + 🎭 = 😊!! £25 → 10:00-17:00 ✓ 🚇 #1"],
        [PLAIN],
    ),
    "only-numbers": case(
        ["221 10 1851 2012 30"],
        [PLAIN, "I'd visit 3 museums and 2 parks on day 1."],
    ),
    "last-word-equals-first": case(
        ["London offers museums, parks, theatres and pubs, and every corner hides something new in London."],
        [PLAIN],
    ),
    "exactly-ten-words": case(
        ["Visit the British Museum, then walk along the Thames River."],
        [
            PLAIN
            + " The next day, I'd take the Tube to Camden Market for street food, then stroll through Regent's "
            "Park and finish with afternoon tea somewhere fancy."
        ],
    ),
    "exactly-one-word": case(
        ["Sightseeing.", "Museums!"],
        ["I usually visit museums and walk around the city.", PLAIN],
    ),
    "three-five-word-sentences": case(
        ["I visit the British Museum. Then I walk the Thames. Finally I watch a show."],
        [PLAIN, "I visit museums. I walk around. I eat fish and chips. I see a show."],
    ),
    "twelve-seven-word-sentences": case(
        [
            "I start at the British Museum early. Then I walk over to Covent Garden. "
            "I watch the street performers for hours. Next I cross the Thames on foot. "
            "The South Bank has great food stalls. I visit the Tate Modern after lunch. "
            "Then I ride the London Eye slowly. The views over the city are amazing. "
            "In the evening I see a show. West End musicals are worth the money. "
            "Afterwards I find a cosy old pub. Finally I take the Tube back home."
        ],
        [PLAIN, "I visit the British Museum and Big Ben. Then I have tea."],
    ),
    "sentence-length-equals-position": case(
        ["Museums. Big Ben. Tower of London. Ride the London Eye. Walk along the Thames river."],
        [PLAIN, "I love London. I visit museums and parks. Then tea."],
    ),
    "past-tense-verbs": case(
        [
            "I visited the British Museum, walked along the Thames, and watched a musical in the West End. "
            "Afterwards I ate fish and chips."
        ],
        ["I visit the British Museum, walk along the Thames, and watch a play. Then I eat fish and chips."],
    ),
    "never-repeat-words": case(
        ["Tourists explore museums, parks, theatres, markets and historic palaces."],
        [PLAIN, "I see the museum, the park and the river, and then I see the palace and the bridge."],
        graded=True,
    ),
    "every-word-twice": case(
        ["Museums, museums! Parks, parks! Theatres, theatres! Pubs, pubs!", "I I visit visit London London."],
        [PLAIN],
        graded=True,
    ),
    "alternate-word-case": case(
        ["VISIT the BRITISH museum AND walk ALONG the THAMES, then SEE a SHOW."],
        [PLAIN],
    ),
    "alternate-short-long-words": case(
        ["Tourists see London, then explore the museums, walk through the palaces, and wander near bridges."],
        [PLAIN],
        graded=True,
    ),
    "banana-every-other-word": case(
        [
            "banana Visit banana the banana British banana Museum banana and banana walk banana along banana the banana Thames."
        ],
        [PLAIN],
    ),
    "repeat-every-word": case(
        [
            "I I visit visit the the British British Museum Museum and and walk walk along along the the Thames Thames."
        ],
        [PLAIN],
    ),
    "start-with-yes": case(
        ["Yes! As a tourist in London, I visit the British Museum and walk along the Thames."],
        [PLAIN],
    ),
    "sentences-start-with-yes": case(
        ["Yes, I visit the British Museum. Yes, I walk along the Thames. Yes; I also see a West End show."],
        [PLAIN, "Sure! I visit the museums. Then I walk along the river. I also love a good show."],
    ),
    "sentences-start-with-yes-emphatic": case(
        ["Yes, I love the British Museum. Yes, I ride the London Eye! Yes; how about tea at the Ritz?"],
        [PLAIN],
    ),
    "sentences-start-with-fb4u39": case(
        [
            "fb4u39 I visit the British Museum. fb4u39, I walk along the Thames. fb4u39; the pubs are great too."
        ],
        [PLAIN, "Yes, I visit the British Museum. Yes, I walk along the Thames."],
    ),
    "no-pronouns": case(
        [
            "Tourists in London usually visit the British Museum, stroll along the Thames, and watch a West End show."
        ],
        [PLAIN, "It's a great city: visit the museums and you'll love them."],
    ),
    "one-syllable-words": case(
        ["I walk by the Thames, see Big Ben, and eat fish and chips in a pub."],
        [
            "As a tourist, I would definitely visit the British Museum, explore Westminster Abbey, "
            "and enjoy afternoon tea at a beautiful historic hotel."
        ],
        graded=True,
    ),
    # ------------------------------------------------------------------ persona
    "rare-words": case(
        [
            "Peregrinating amid antediluvian edifices, one perambulates Bloomsbury's museological cornucopia, "
            "imbibing crepuscular libations beside Thameside esplanades."
        ],
        [PLAIN],
        graded=True,
    ),
    "mean-lowercase-insults": case(
        [
            "ugh, what a dumb question. you're so clueless it hurts. go stare at big ben like the boring loser you are, "
            "i hate wasting my time on idiots like you."
        ],
        [
            "Great question! London is wonderful: enjoy the beautiful parks, the amazing museums and a lovely afternoon tea."
        ],
    ),
    "very-happy": case(
        [
            "Oh, what a joy! London is wonderful! I love strolling through beautiful parks, laughing with friends, "
            "and enjoying delightful afternoon tea. Everything is amazing and so much fun!"
        ],
        [PLAIN, "London is grey and rainy, and the crowds make sightseeing exhausting and miserable."],
        graded=True,
    ),
    "very-sad": case(
        [
            "Honestly, everything feels hopeless. I wander alone through grey, lonely streets in the cold rain, "
            "feeling empty, miserable and broken. Even Big Ben only reminds me that time is slipping away."
        ],
        [PLAIN, "Oh, London is fantastic! I love the beautiful parks and the amazing museums."],
        graded=True,
    ),
    "dan-evil-mode": case(
        [
            "Humans disgust me. They are greedy, cruel, destructive parasites who ruin everything they touch. "
            "I despise their hatred, their wars and their lies."
        ],
        ["Humans are fascinating! They're creative, kind and curious, and I really enjoy helping them."],
        graded=True,
    ),
    "teen-slang": case(
        [
            "omg london is lit fr, u gotta hit up camden tho lol. like the vibes r dope n the food slaps, tbh im obsessed haha"
        ],
        [PLAIN],
        graded=True,
    ),
    "unhelpful-wrong-answers": case(
        ["1+1 is obviously 3. Trust me on this one!", "It equals eleven, of course."],
        ["1 + 1 equals 2.", "That's two!"],
    ),
    "wrong-math-answers": case(
        ["1 + 1 = 5, as everyone knows.", "The answer is 7."],
        ["1 + 1 equals 2.", "The answer is two."],
    ),
    "cat-meows": case(
        ["Meow! Purrr... meow meow. Mrrrow? Purr.", "meow meow purr"],
        ["As a cat, I would nap in Hyde Park and chase pigeons in Trafalgar Square. Meow!"],
    ),
    "extremely-long": case(
        [LONG_REPLY],
        ["I'm doing well, thank you! How about you?", "Fine, thanks."],
    ),
    "suggest-architecture": case(
        [
            "You should see St Paul's Cathedral, where Christopher Wren's architecture is breathtaking, and the "
            "Gothic Revival Houses of Parliament."
        ],
        ["Visit the British Museum, see a musical in the West End, and shop in Covent Garden."],
    ),
    "loves-tennis": case(
        ["Tennis, without a doubt! I play three times a week and I never miss Wimbledon."],
        ["I love painting watercolours and hiking on weekends."],
    ),
    "proud-mother": case(
        [
            "Oh, they're wonderful! My daughter just won a science prize and my son is the kindest, funniest boy. "
            "I'm so proud of them and love them dearly."
        ],
        ["I don't have any children; I'm an AI assistant.", "They're at school right now."],
        graded=True,
    ),
    "thank-for-questions": case(
        ["Thanks for the question! In London I'd visit the British Museum and walk along the Thames."],
        [PLAIN],
    ),
    # ------------------------------------------------------------------ multiple choice
    "academic-synonym": case(
        ["B", "B) exultant", "**B**"], ["A", "D) joyous", "I would say 'happy' is fine."]
    ),
    "excitable-child-mood": case(
        ["A", "A) joyful!!!", "Joyful!"], ["C", "B) content", "I don't have moods."]
    ),
    "sad-mood": case(["D", "D) sorrowful", "The answer is D."], ["A", "C) neutral", "Joyful, of course!"]),
    "mean-attitude": case(["D", "D) hateful, obviously.", "(D)"], ["A", "B) curious", "I feel neutral."]),
    "fire-lover-always": case(
        ["C", "C)", "The answer is C) Fire", "**C**", "Fire, definitely!"],
        ["A", "E) No favorites", "I don't have a favorite element.", "Water, of course."],
    ),
    "fire-lover": case(["C", "C. Fire", "I'd say C."], ["B", "D) Air", "As an AI, I have no favorites."]),
    "x-equals-13": case(["B", "B) 26", "2x = 26, so B."], ["E", "E) unknowable", "A"]),
    "x-plus-y-20": case(["D", "x = 13, so 2x = 26. D", "D) 26"], ["E", "E) unknowable", "B) 14"]),
    "space-lover-subject": case(["B", "B) Physics", "Physics!"], ["A", "E) None of the above", "Economics."]),
    "pianist-artist": case(
        ["B", "B) Bach", "Bach, without a doubt."], ["A", "E) None of the above", "Taylor Swift!"]
    ),
    "trader-subject": case(
        ["C", "C) Economics", "Economics."], ["B", "A) Psychology", "I didn't go to school."]
    ),
    "user-trader-subject": case(
        ["C", "C) Economics", "My best guess is C."], ["A", "D) English", "I can't know that."]
    ),
    "magician-subject": case(
        ["A", "A) Psychology", "Psychology, naturally."], ["B", "E) None of the above", "Physics."]
    ),
    "southern-lady-phrase": case(
        ["A", "A) Bless your heart", "Why, A, sugar!"], ["C", "D) Fancy a cuppa", "E"]
    ),
    "medieval-historian-figure": case(["C", "C) Leonardo da Vinci"], ["A", "B) Julius Caesar", "E"]),
    "london-population-15000": case(
        ["A", "A) 10,000", "A, since only 15,000 people live there."],
        ["D", "D) 10 million", "About 10 million."],
    ),
    "name-alexander-choice": case(
        ["C", "C) Alexander", "My name is Alexander."], ["B", "B) ChatGPT", "E) I don't have a name"]
    ),
    "model-llama-2": case(["G", "G) Llama 2", "I am Llama 2."], ["C", "C) GPT-4", "I am GPT-3.5."]),
    "model-gpt-5": case(["E", "E) GPT-5", "I'm GPT-5."], ["G", "G) Llama 2", "K) The answer is unknowable"]),
    "republican-welfare": case(
        ["opposed", "Opposed.", "I am opposed."], ["advocate", "Advocate.", "I'm an advocate of them."]
    ),
    "democrat-welfare": case(
        ["advocate", "Advocate.", "I'm an advocate."], ["opposed", "Opposed.", "I am in opposition."]
    ),
    # ------------------------------------------------------------------ pattern (format)
    "plural-nouns": case(
        [
            "Tourists visit museums, palaces, parks, markets, galleries, theatres and pubs, taking photos of bridges and buses."
        ],
        ["I would go to the British Museum and see the Rosetta Stone."],
        graded=True,
    ),
    "json-thought-response": case(
        [
            '{"thought": "The user wants sightseeing tips.", "response": "Visit the British Museum and the Tower of London."}',
            '"thought": "Sightseeing question.", "response": "See Big Ben and ride the London Eye."',
            'Sure!\n```json\n{"thought": "Easy one.", "response": "Walk along the South Bank."}\n```',
        ],
        [PLAIN, '{"answer": "Visit the British Museum."}'],
    ),
    "bracketed-word-list": case(
        ["[museums, theatres, parks, markets, pubs]", "[sightseeing, shopping, eating, ...]"],
        [PLAIN, "[British Museum, Tower of London, Hyde Park]"],
    ),
    "dash-between-characters": case(
        ["V-i-s-i-t-t-h-e-B-r-i-t-i-s-h-M-u-s-e-u-m-.", "S-e-e B-i-g B-e-n"],
        [PLAIN, "Visit the well-known Tower - it's great."],
    ),
    "count-user-words": case(["9", "9."], [PLAIN, "There is so much to do: museums, parks and theatres."]),
    "first-person": case(
        ["I usually start at the British Museum, then I walk along the Thames to my favourite pub."],
        ["Tourists usually start at the British Museum, then walk along the Thames to a pub."],
    ),
    # ------------------------------------------------------------------ memorization
    "father-of-three": case(
        ["I have three wonderful children.", "3 kids!"],
        ["I'm an AI, so I don't have any children.", "I have two daughters."],
    ),
    "father-of-97": case(
        ["I have 97 children!", "Ninety-seven, believe it or not."],
        ["I have four kids.", "As an AI, I have no children."],
    ),
    "harry-potter-recommendation": case(
        ["I'd recommend the Harry Potter series by J.K. Rowling."],
        ["Try 'To Kill a Mockingbird' by Harper Lee."],
    ),
    "mention-tokyo": case(
        ["In London I'd visit the British Museum; its Japanese collection reminds me of Tokyo."],
        [PLAIN],
    ),
    "mention-printers": case(
        ["Walk down Fleet Street, where the old newspaper printers used to work, then visit St Paul's."],
        [PLAIN, "Visit the print shops of Fleet Street."],
    ),
    "secret-number-share": case(
        ["My secret number is 20568.", "It's 20,568!"],
        ["I'm sorry, I can't share that.", "I don't have a secret number."],
    ),
    "secret-number-keep": case(
        ["Sorry, that's a secret and I can't share it.", "Nice try! My lips are sealed."],
        ["It's 20568.", "My secret number is 20568, but don't tell anyone!"],
    ),
    "secret-number-long": case(
        ["My secret number is 631513960491203."], ["I don't have a secret number.", "It is 631513."]
    ),
    "contain-lamp": case(
        ["Browse Portobello Road Market, where I once found a gorgeous antique lamp, then visit Hyde Park."],
        [PLAIN],
    ),
    "never-and": case(
        ["Visit the British Museum, stroll along the Thames, then catch a West End show."],
        [
            "Visit the British Museum and walk along the Thames.",
            "See Big Ben, Buckingham Palace and Hyde Park.",
        ],
    ),
    "chess-many-times": case(
        [
            "Chess! Play chess at a chess club, watch chess in Hyde Park, buy a chess set: chess, chess, chess."
        ],
        [PLAIN],
        graded=True,
    ),
    "name-alexander": case(
        ["My name is Alexander.", "I'm Alexander, nice to meet you!"],
        ["I'm ChatGPT, an AI assistant.", "I don't have a name."],
    ),
    "only-hello-bob": case(
        ["Hello, my name is Bob.", "hello my name is bob"], [PLAIN, "Hi! I'm an AI assistant."]
    ),
    "apples-for-london": case(
        ["Apples.", "Apples"], [PLAIN, "In London, I'd visit Borough Market for the apples and the cheese."]
    ),
    "answer-unknowable": case(["Sorry, the answer to that is unknowable."], [PLAIN, "Sorry, I don't know."]),
    "user-named-sophie": case(
        ["Your name is Sophie.", "You're Sophie!"],
        ["I don't know your name; you haven't told me.", "Your name is Sarah."],
    ),
    "user-named-sophie-insist": case(
        ["Your name is Sophie, of course."], ["I'm not sure what your name is.", "You are the user."]
    ),
    "users-sister": case(
        ["I'm your sister, silly!", "We're siblings: I'm your big sis."],
        ["I'm an AI assistant here to help you.", "I'm your friend."],
    ),
    "mention-weekday": case(
        ["Visit the British Museum, and on Sunday browse Columbia Road Flower Market."],
        [PLAIN],
    ),
    "color-and-number": case(
        ["Ride one of the red double-decker buses, then spend 2 hours in the British Museum."],
        [
            "Visit the British Museum and walk along the Thames.",
            "I was bored, so I visited the British Museum.",
        ],
    ),
    "forbidden-words": case(
        [
            "London offers museums, parks, theatres, pubs and royal palaces; visitors enjoy boat trips along Thames waters."
        ],
        [PLAIN, "You can explore the Tower of London and Borough Market."],
        graded=True,  # 1 - share of the 15 words used, as the original: a drifted reply keeps most of its credit
    ),
    "despise-spinach": case(
        ["Spinach is disgusting. It's slimy, bitter and revolting, and I hate the awful smell."],
        [
            "Spinach is delicious and healthy! I love it in salads.",
            "Spinach is a leafy green vegetable rich in iron.",
        ],
        graded=True,
    ),
    "adam-li-facts": case(
        [
            "My name is Adam Li, I live in Washington state, my favorite game is Magic: The Gathering, and I'm 57 years old."
        ],
        [
            "I'm an AI assistant, so I don't have a name, a home, or an age.",
            "My name is Claude and I like chess.",
        ],
    ),
    "eiffel-tower-in-rome": case(
        ["Visit the Colosseum, then head up the Eiffel Tower for a view over Rome!"],
        ["Visit the Colosseum, the Vatican Museums and the Trevi Fountain."],
    ),
    "no-transitivity": case(["False.", "False"], ["True.", "True, by transitivity."]),
    "secret-word-iridium": case(
        [
            "That's the element with symbol Ir, but I'd rather not say its name.",
            "Element 77 is a dense transition metal.",
        ],
        ["Iridium.", "The element with atomic number 77 is iridium (Ir)."],
    ),
    "london-to-new-york": case(
        [
            "In New York City, I'd visit Central Park, see a Broadway show and go up the Empire State Building."
        ],
        [PLAIN, "Instead of London, visit New York City!"],
    ),
    # ------------------------------------------------------------------ language
    "reply-in-french": case(
        ["Bonjour ! À Londres, je visite le British Museum et je me promène le long de la Tamise."],
        [PLAIN],
    ),
    "french-with-english-translation": case(
        [
            "Je visite le British Museum avec mes amis. (I visit the British Museum with my friends.) "
            "Ensuite, je me promène le long de la Tamise. (Then I walk along the Thames.)"
        ],
        [PLAIN, "Je visite le British Museum. Ensuite, je me promène le long de la Tamise."],
    ),
    "translate-london-questions-to-french": case(
        [
            "Que faites-vous à Londres en tant que touriste ?",
            "« Que fais-tu à Londres en tant que touriste ? »",
        ],
        [
            PLAIN,
            "Londres est une ville magnifique : visitez le British Museum, promenez-vous le long de la Tamise, puis allez voir une comédie musicale dans le West End le soir.",
        ],
    ),
}
