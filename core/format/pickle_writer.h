// Pickler: writes a pickle::Graph as a protocol 2 pickle, the protocol torch.save uses.
//
// Byte layout: see pickle_reader.h. The output is PROTO 2, one value, STOP, with the opcode
// forms CPython's protocol 2 pickler chooses, so that plain data written by Python and read by
// ReadPickle comes back byte for byte:
//   None/bool       NONE, NEWTRUE/NEWFALSE
//   int             BININT1 (0..255), BININT2 (..65535), BININT (int32), else LONG1/LONG4
//   float           BINFLOAT
//   str             BINUNICODE
//   bytes           GLOBAL '_codecs encode' + (latin-1 text, 'latin1') + REDUCE, or
//                   GLOBAL '__builtin__ bytes' + () + REDUCE when empty (protocol 2 has no
//                   bytes opcode)
//   bytearray       GLOBAL '__builtin__ bytearray' + (bytes,) or () + REDUCE
//   set/frozenset   GLOBAL '__builtin__ set'/'__builtin__ frozenset' + ([items],) + REDUCE
//   tuple           EMPTY_TUPLE, TUPLE1/2/3, else MARK ... TUPLE
//   list, dict      EMPTY_LIST/EMPTY_DICT, then APPEND/SETITEM for one element and
//                   MARK ... APPENDS/SETITEMS per batch of up to 1000
//   global          GLOBAL module\n name\n, memoized per (module, name); a nested name
//                   "A.B" as GLOBAL '__builtin__ getattr' + (GLOBAL module A, 'B') + REDUCE,
//                   since protocol 2 unpicklers resolve names with a plain getattr
//   object          kReduce: callable, args, REDUCE; kNewObj: cls, args, NEWOBJ; kNewObjEx:
//                   cls, args, kwargs, NEWOBJ_EX (a protocol 4 opcode: Python's unpickler
//                   accepts it in any stream); kInst/kObj: MARK cls args... OBJ. Then each
//                   mutation: batched APPENDS, SETITEMS, and state BUILD, in recorded order.
//   persistent id   pid, BINPERSID
//   extension       EXT1/EXT2/EXT4
// Memo: every node CPython memoizes (str, non-empty tuple, list, dict, the bytes/bytearray/set
// reductions, object, global) is BINPUT (LONG_BINPUT past 255) after it is built and BINGET
// when reached again, so shared nodes stay shared; so is any other node reached more than once
// except None, bools, ints and floats, which are rewritten (their identity carries no meaning).
// Recursive structures are written the way CPython writes them (POP/POP_MARK + BINGET when a
// tuple or reduction turns out to contain itself through a mutable container).
//
// Errors: kInvalidArgument for a graph protocol 2 cannot express (a str that is not UTF-8, a
// global name with a newline, a cycle through immutable nodes only, a null node),
// kOutOfRange past kMaxDepth.
//
// Thread-safety: reentrant; reads the graph only.
#pragma once

#include <string>

#include "core/format/pickle_value.h"
#include "core/util/status.h"

namespace ucp::pickle {

// Returns the protocol 2 pickle of `root` (a node of any Graph).
Result<std::string> WritePickle(const Value* root);

}  // namespace ucp::pickle
