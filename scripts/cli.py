def main():
    print("genrec")
